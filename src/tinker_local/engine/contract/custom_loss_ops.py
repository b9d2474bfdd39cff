"""What a server-side custom loss may do, by name, and the check of a traced graph against it.

The SDK traces a custom loss with torch.fx and sends its nodes as plain data
(`types.CustomLossGraph`): each call names a function by its qualified name (`torch.exp`,
`operator.mul`, `torch._C._nn.softplus`, ...) or a tensor method by its name (`sum`). Nothing in
it runs until the engine rebuilds it (engine/losses/custom.py), and the engine rebuilds only what these
lists name: a name off them is refused here, before the loss is stored, with the name in the
message. The lists are names only (no torch), so the server can check a graph the moment it
arrives; tests/engine/test_custom_loss_allow_list.py checks that every name resolves to a torch, operator
or math function, and that tracing the common operations produces these names.

Everything here is differentiable tensor math or plain Python arithmetic on shapes: no I/O, no
in-place methods, no module state, nothing that leaves torch (`item`, `numpy`, `tolist`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from tinker import types

from tinker_local.engine.errors import user_error

# Functions a loss may call, by the name torch.fx records (operator.* for Python syntax).
ALLOWED_FUNCTIONS = frozenset(
    {
        # elementwise math
        *(f"torch.{n}" for n in (
            "abs", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt",
            "square", "pow", "sigmoid", "tanh", "relu", "sign", "neg", "reciprocal", "clamp",
            "clip", "where", "maximum", "minimum", "minimum", "logaddexp", "lerp", "floor",
            "ceil", "round", "trunc", "fmod", "remainder", "sin", "cos", "erf", "erfc",
            "isfinite", "isnan", "nan_to_num", "logical_and", "logical_or", "logical_not",
            "add", "sub", "mul", "div", "true_divide",
        )),
        # reductions and shapes
        *(f"torch.{n}" for n in (
            "sum", "mean", "max", "min", "amax", "amin", "argmax", "argmin", "prod", "cumsum",
            "std", "var", "norm", "logsumexp", "softmax", "log_softmax", "count_nonzero", "any",
            "all", "stack", "cat", "gather", "masked_fill", "squeeze", "unsqueeze", "reshape",
            "flatten", "transpose", "dot", "matmul", "outer", "einsum", "topk", "sort",
        )),
        # constructors (values, never storage from elsewhere)
        *(f"torch.{n}" for n in (
            "zeros_like", "ones_like", "full_like", "zeros", "ones", "full", "arange",
            "tensor", "as_tensor",
        )),
        # torch.nn.functional, as fx names them
        *(f"torch.nn.functional.{n}" for n in (
            "relu", "softmax", "log_softmax", "kl_div", "mse_loss", "l1_loss", "smooth_l1_loss",
            "huber_loss", "cross_entropy", "nll_loss", "binary_cross_entropy_with_logits",
            "silu", "sigmoid", "tanh", "normalize", "pad",
        )),
        "torch._C._nn.log_sigmoid",
        "torch._C._nn.softplus",
        "torch._C._nn.gelu",
        "torch._C._nn.one_hot",
        # Python syntax on tensors and shapes
        *(f"operator.{n}" for n in (
            "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
            "invert", "getitem", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor",
            "matmul",
        )),
        *(f"math.{n}" for n in ("log", "exp", "sqrt", "pow")),
        "getattr",  # only for the attributes below
    }
)
# Tensor attributes `getattr` may read (`x.shape`, `x.ndim`, ...).
ALLOWED_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T", "mT"})
# Tensor methods a loss may call (none in place, none leaving torch).
ALLOWED_METHODS = frozenset(
    {
        "abs", "add", "all", "amax", "amin", "any", "argmax", "argmin", "bool", "clamp", "clip",
        "cumsum", "detach", "dim", "div", "double", "exp", "exp2", "expand", "expand_as",
        "flatten", "float", "gather", "int", "isfinite", "log", "log1p", "log_softmax",
        "logsumexp", "long", "masked_fill", "max", "mean", "min", "mul", "nan_to_num", "neg",
        "new_full", "new_ones", "new_zeros",
        "norm", "numel", "permute", "pow", "prod", "reciprocal", "relu", "reshape", "sigmoid",
        "sign", "size", "softmax", "sort", "sqrt", "square", "squeeze", "std", "sub", "sum", "t",
        "tanh", "to", "topk", "transpose", "type_as", "unsqueeze", "var", "view", "where",
    }
)
ALLOWED_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int64", "int32", "bool"})
ALLOWED_LAYOUTS = frozenset({"strided"})
ALLOWED_MEMORY_FORMATS = frozenset({"contiguous_format", "preserve_format"})
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
MAX_NODES = 10_000
MAX_INPUTS = 16


def check_custom_loss(
    name: str, inputs: Sequence[types.CustomLossInput], graph: types.CustomLossGraph
) -> None:
    """Raise `EngineError` ("user") naming the first thing in the graph that is not allowed, or
    that does not fit together (a reference to no earlier node, an output that is not
    (loss, metrics), placeholders that are not the declared inputs)."""
    where = f"custom loss {name!r}"
    if not inputs or inputs[0].name != "logprobs" or inputs[0].rank == 0:
        raise user_error(f"{where}: its first input must be logprobs, of rank 1 or 2")
    if len(inputs) > MAX_INPUTS:
        raise user_error(f"{where}: takes {len(inputs)} inputs; at most {MAX_INPUTS}")
    names = [i.name for i in inputs]
    for input_name in names:
        if not INPUT_NAME.fullmatch(input_name):
            raise user_error(f"{where}: input name {input_name!r} is not a lowercase identifier")
    if len(set(names)) != len(names):
        raise user_error(f"{where}: input names repeat: {names}")
    nodes = graph.nodes
    if not nodes or len(nodes) > MAX_NODES:
        raise user_error(f"{where}: a graph has 1 to {MAX_NODES} nodes, got {len(nodes)}")
    placeholders = [n.target for n in nodes if n.op == "placeholder"]
    if placeholders != names:
        raise user_error(
            f"{where}: the graph's parameters {placeholders} are not its declared inputs {names}"
        )
    seen: set[str] = set()
    for index, node in enumerate(nodes):
        what = f"{where}: node {index} ({node.name!r})"
        if node.name in seen:
            raise user_error(f"{what}: the name is used twice")
        if node.op == "call_function":
            if node.target not in ALLOWED_FUNCTIONS:
                raise user_error(
                    f"{what} calls {node.target!r}, which is not on tinker-local's list of "
                    "operations a server-side custom loss may use (docs/losses.md)"
                )
            if node.target == "getattr" and not _reads_allowed_attribute(node.args):
                raise user_error(
                    f"{what} reads attribute {node.args[1:2]!r}; allowed: "
                    f"{sorted(ALLOWED_ATTRIBUTES)}"
                )
        elif node.op == "call_method":
            if node.target not in ALLOWED_METHODS:
                raise user_error(
                    f"{what} calls tensor method {node.target!r}, which is not on tinker-local's "
                    "list of operations a server-side custom loss may use (docs/losses.md)"
                )
        elif node.op == "output":
            if index != len(nodes) - 1:
                raise user_error(f"{what}: the output must be the last node")
            _check_output(what, node.args)
        elif node.op != "placeholder":
            raise user_error(
                f"{what} is a {node.op!r} node (target {node.target!r}); a custom loss may not "
                "use one: it reads only logprobs and the inputs it names, through functions"
            )
        for value in (*node.args, *node.kwargs.values()):
            _check_arg(what, value, seen)
        seen.add(node.name)
    if nodes[-1].op != "output":
        raise user_error(f"{where}: the graph has no output node")


def _reads_allowed_attribute(args: list[Any]) -> bool:
    return len(args) == 2 and isinstance(args[1], str) and args[1] in ALLOWED_ATTRIBUTES


def _check_output(what: str, args: list[Any]) -> None:
    value = args[0] if len(args) == 1 else None
    pair = value.get("tuple") if isinstance(value, dict) else value
    if not (isinstance(pair, list) and len(pair) == 2):
        raise user_error(f"{what}: a custom loss returns (loss, metrics)")
    loss, metrics = pair
    if not (isinstance(loss, dict) and set(loss) == {"ref"}):
        raise user_error(f"{what}: the loss it returns must be a tensor the graph computes")
    entries = metrics.get("dict") if isinstance(metrics, dict) else None
    if not isinstance(entries, dict):
        raise user_error(f"{what}: the metrics it returns must be a dict")
    for key, metric in entries.items():
        if not METRIC_KEY.fullmatch(key):
            raise user_error(
                f"{what}: metric {key!r} must be named custom/<name>:sum or custom/<name>:mean"
            )
        if not (isinstance(metric, dict) and set(metric) == {"ref"}):
            raise user_error(f"{what}: metric {key!r} must be a tensor the graph computes")


def _check_arg(what: str, value: Any, seen: set[str], depth: int = 0) -> None:
    """An encoded argument (types.CustomLossNode.args) of a known form, referring only to nodes
    that come earlier."""
    if depth > 32:
        raise user_error(f"{what}: an argument is nested too deeply")
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for item in value:
            _check_arg(what, item, seen, depth + 1)
        return
    if not (isinstance(value, dict) and len(value) == 1):
        raise user_error(f"{what}: an argument {value!r} is not in the graph encoding")
    (kind, inner), = value.items()
    if kind == "ref":
        if inner not in seen:
            raise user_error(f"{what}: refers to {inner!r}, which is no earlier node")
    elif kind in ("tuple", "slice"):
        if not isinstance(inner, list) or (kind == "slice" and len(inner) != 3):
            raise user_error(f"{what}: a malformed {kind} argument")
        for item in inner:
            _check_arg(what, item, seen, depth + 1)
    elif kind == "dict":
        if not isinstance(inner, dict) or not all(isinstance(k, str) for k in inner):
            raise user_error(f"{what}: a malformed dict argument")
        for item in inner.values():
            _check_arg(what, item, seen, depth + 1)
    elif kind == "float":
        if inner not in ("inf", "-inf", "nan"):
            raise user_error(f"{what}: float constant {inner!r} is not inf, -inf or nan")
    elif kind == "ellipsis":
        if inner is not True:
            raise user_error(f"{what}: a malformed ellipsis argument")
    elif kind == "dtype":
        if inner not in ALLOWED_DTYPES:
            raise user_error(f"{what}: dtype {inner!r} is not one of {sorted(ALLOWED_DTYPES)}")
    elif kind == "device":
        if not isinstance(inner, str):
            raise user_error(f"{what}: a malformed device argument")
    elif kind == "layout":
        if inner not in ALLOWED_LAYOUTS:
            raise user_error(f"{what}: layout {inner!r} is not supported")
    elif kind == "memory_format":
        if inner not in ALLOWED_MEMORY_FORMATS:
            raise user_error(f"{what}: memory format {inner!r} is not supported")
    else:
        raise user_error(f"{what}: argument kind {kind!r} is not in the graph encoding")
