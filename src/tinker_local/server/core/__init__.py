"""What every call goes through: the Service (futures, the engine worker thread, seq_id order),
in-memory state and its SQLite store, owners, limits, errors, tinker:// paths, traces, audit."""
