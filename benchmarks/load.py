"""Load: N client processes against one `tinker-local serve` (not a timed test).

    .venv/bin/python benchmarks/load.py [--clients 8] [--duration 60] [--model tinker-local/tiny-llama]

Starts `tinker-local serve` on a free loopback port, then N client processes, each with its own
session and LoRA adapter, looping `forward_backward` -> `optim_step` -> `sample` through the
official SDK for `--duration` seconds (all start together once every client is set up). Prints a
table (requests/s, p50/p99 latency per call, errors) and the server's peak RSS, and writes the
numbers to benchmarks/results/load.json. Traffic stays on 127.0.0.1; every loop is time-bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "load.json"
API_KEY = "tml-local"
OPS = ("forward_backward", "optim_step", "sample")


# -- one client process -------------------------------------------------------------------------


def client_main(args: argparse.Namespace) -> None:
    """Set up, say "ready", wait for "go" on stdin, loop until the deadline, print JSON."""
    import tinker
    from tinker import types

    rng = random.Random(args.seed)
    service = tinker.ServiceClient(base_url=args.base_url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model=args.model, rank=8).result()
    sampling = training.save_weights_and_get_sampling_client(f"load-{args.seed}").result()
    vocab = 1000  # ordinary token ids, valid for every model the server has

    def datum() -> types.Datum:
        tokens = [rng.randrange(10, vocab) for _ in range(args.seq_len + 1)]
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * args.seq_len},
        )

    adam = types.AdamParams(learning_rate=1e-4)
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])
    latencies: dict[str, list[float]] = {op: [] for op in OPS}
    errors: dict[str, list[str]] = {op: [] for op in OPS}

    def timed(op: str, call, *call_args) -> None:
        start = time.perf_counter()
        try:
            call(*call_args).result()
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
            errors[op].append(f"{type(exc).__name__}: {exc}"[:300])
        else:
            latencies[op].append(time.perf_counter() - start)

    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    deadline = time.monotonic() + args.duration
    while time.monotonic() < deadline:
        batch = [datum() for _ in range(args.batch)]
        timed("forward_backward", training.forward_backward, batch, "cross_entropy")
        timed("optim_step", training.optim_step, adam)
        prompt = types.ModelInput.from_ints([rng.randrange(10, vocab) for _ in range(16)])
        timed("sample", sampling.sample, prompt, 1, params)
    print(json.dumps({"latencies": latencies, "errors": errors}), flush=True)


# -- the coordinator ------------------------------------------------------------------------------


def _start_server(env: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    out = log.open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tinker_local.cli",
            "serve",
            "--port",
            "0",
            "--log-level",
            "WARNING",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tinker-local serve exited {proc.returncode}:\n{log.read_text()}")
        found = re.search(r"tinker-local serving at (http://\S+)", log.read_text())
        if found:
            try:
                with urllib.request.urlopen(f"{found[1]}/api/v1/healthz", timeout=5):
                    return proc, found[1]
            except OSError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"tinker-local serve did not start within 300 s:\n{log.read_text()}")


def _rss_mib(pid: int, field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of a process, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run(args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["TINKER_TELEMETRY"] = "0"
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    load_at_start = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="tinker-local-load-"))
    server, base_url = _start_server(env, workdir / "serve.log")
    clients: list[subprocess.Popen] = []
    try:
        for i in range(args.clients):
            cmd = [sys.executable, __file__, "--client", "--base-url", base_url, "--seed", str(i)]
            cmd += ["--model", args.model, "--duration", str(args.duration)]
            cmd += ["--batch", str(args.batch), "--seq-len", str(args.seq_len)]
            cmd += ["--max-tokens", str(args.max_tokens)]
            clients.append(
                subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
                )
            )
        for i, client in enumerate(clients):
            line = client.stdout.readline().strip()
            if line != "ready":
                raise SystemExit(f"client {i} failed to set up (said {line!r}); see its stderr")
        start = time.monotonic()
        for client in clients:
            client.stdin.write("go\n")
            client.stdin.flush()
        rss_now_max = 0.0
        while any(c.poll() is None for c in clients):
            rss_now_max = max(rss_now_max, _rss_mib(server.pid, "VmRSS"))
            time.sleep(0.25)
            if time.monotonic() - start > args.duration + 300:
                raise SystemExit("clients did not finish within duration + 300 s")
        wall = time.monotonic() - start
        peak_rss = max(rss_now_max, _rss_mib(server.pid, "VmHWM"))
        results = []
        for i, client in enumerate(clients):
            out = client.stdout.read().strip().splitlines()
            if client.returncode != 0 or not out:
                raise SystemExit(f"client {i} exited {client.returncode}")
            results.append(json.loads(out[-1]))
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(workdir, ignore_errors=True)

    ops = {}
    all_latencies: list[float] = []
    error_samples: list[str] = []
    for op in OPS:
        lat = [x for r in results for x in r["latencies"][op]]
        errs = [e for r in results for e in r["errors"][op]]
        all_latencies += lat
        error_samples += errs[:3]
        ops[op] = {
            "requests": len(lat) + len(errs),
            "requests_per_s": (len(lat) + len(errs)) / wall,
            "p50_ms": 1000 * _percentile(lat, 0.50),
            "p99_ms": 1000 * _percentile(lat, 0.99),
            "mean_ms": 1000 * statistics.fmean(lat) if lat else float("nan"),
            "errors": len(errs),
        }
    total_requests = sum(o["requests"] for o in ops.values())
    return {
        "model": args.model,
        "clients": args.clients,
        "duration_s": args.duration,
        "wall_s": wall,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "max_tokens": args.max_tokens,
        "loops": ops["sample"]["requests"],
        "requests": total_requests,
        "requests_per_s": total_requests / wall,
        "p50_ms": 1000 * _percentile(all_latencies, 0.50),
        "p99_ms": 1000 * _percentile(all_latencies, 0.99),
        "errors": sum(o["errors"] for o in ops.values()),
        "error_samples": error_samples,
        "server_peak_rss_mib": peak_rss,
        "ops": ops,
        "cpu_count": os.cpu_count(),
        # Other work on the machine skews every number here: the 1/5/15-minute load averages.
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
    }


def print_table(result: dict) -> None:
    print(
        f"\n{result['clients']} clients x {result['duration_s']} s on {result['model']} "
        f"(batch {result['batch']} x {result['seq_len']} tokens, sample {result['max_tokens']} "
        f"tokens); {result['loops']} loops in {result['wall_s']:.1f} s"
    )
    header = f"{'call':<18}{'requests':>10}{'req/s':>9}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}"
    print(header)
    print("-" * len(header))
    rows = [(op, result["ops"][op]) for op in OPS]
    rows.append(("all", result))
    for name, row in rows:
        print(
            f"{name:<18}{row['requests']:>10}{row['requests_per_s']:>9.1f}"
            f"{row['p50_ms']:>10.1f}{row['p99_ms']:>10.1f}{row['errors']:>8}"
        )
    print(f"server peak RSS: {result['server_peak_rss_mib']:.0f} MiB")
    start, end = result["load_average_at_start"], result["load_average_at_end"]
    print(
        f"load average (1 min) at start {start[0]:.1f}, at end {end[0]:.1f} "
        f"on {result['cpu_count']} CPUs"
    )
    for sample in result["error_samples"]:
        print(f"error: {sample}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--model", default="tinker-local/tiny-llama")
    parser.add_argument("--batch", type=int, default=4, help="datums per forward_backward")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per datum")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per sample")
    parser.add_argument("--out", type=Path, help=f"the JSON file (default: results/{RESULTS.name})")
    parser.add_argument("--smoke", action="store_true",
                        help="1 client for 2 s: checks the script runs; written to a temporary "
                             "folder unless --out is given")
    # internal: one client process
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        client_main(args)
        return
    if args.smoke:
        args.clients, args.duration, args.batch, args.seq_len, args.max_tokens = 1, 2.0, 2, 8, 4
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="smoke-")) / RESULTS.name if args.smoke else RESULTS
    result = run(args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if result["errors"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
