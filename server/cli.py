"""The server's subcommand of `kvbridge`: `serve`."""

from __future__ import annotations

import argparse
import dataclasses

from kvbridge.transfer.devices import DTYPE_NAMES


def cmd_serve(args: argparse.Namespace) -> int:
    from kvbridge.server.app import serve, setup_logging
    from kvbridge.server.config import ServeConfig

    overrides = {k: getattr(args, k) for k in (
        "preset", "source", "target", "device", "dtype", "adapters", "default_adapter", "store_device",
        "store_capacity_mb", "cpu_tier_mb", "block_size", "redis_url", "redis_secret_file", "default_ttl_s", "listen",
        "tls_cert", "tls_key",
        "token_file", "max_message_mb", "chunk_kb", "workers", "stream_workers", "stream_threads_per_tenant",
        "uploads_per_tenant",
        "stream_idle_s", "max_projections", "tenant_max_entries", "tenant_max_pinned_mb", "metrics_listen", "grace_s",
        "detector_layers", "shm_ttl_s", "shm_max_mb", "shm_keep_s", "shm_headroom_tokens",
        "stream_keep_mb", "stream_keep_s", "correction", "max_corrections", "correction_prior_file")}
    for flag in ("fit_adapter", "allow_remote_without_tokens", "log_json", "detector_strict", "redis_insecure"):
        overrides[flag] = True if getattr(args, flag) else None
    overrides["selfcheck"] = False if args.no_selfcheck else None
    overrides["source_weights"] = False if args.no_source_weights else None
    overrides["correction_prior"] = False if args.no_correction_prior else None
    if args.shm_dir and not args.no_shm:
        overrides["shm_dir"] = args.shm_dir
    config = ServeConfig.load(args.config, **overrides)
    if args.no_shm:  # (an override of None means "not given": load keeps the default or the TOML's folder)
        config = dataclasses.replace(config, shm_dir=None)
    setup_logging(verbose=True, as_json=config.log_json)  # the flag, or the TOML's log_json
    return serve(config, ready_file=args.ready_file)


def add_parsers(sub) -> None:
    from kvbridge.transfer.presets import PRESETS

    p = sub.add_parser("serve", help="run the gRPC service (kvbridge.v1) until SIGINT/SIGTERM")
    p.add_argument("--config", metavar="TOML", help="a TOML file of ServeConfig fields; flags override it")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model pair (default small)")
    p.add_argument("--source", help="production preset: source model folder or cached repo id")
    p.add_argument("--target", help="production preset: target model folder or cached repo id")
    p.add_argument("--no-source-weights", action="store_true",
                   help="load the source model without its weights (its tokenizer, shapes and RoPE only): its KV "
                        "comes from PutSourceKV or a vLLM engine that saves it (kv_role kv_producer); Ingest by "
                        "text is refused. A 7B source then costs no GPU memory")
    p.add_argument("--device", default=None, help="where models run: cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default=None, choices=DTYPE_NAMES,
                   help="the models' dtype (default auto: bfloat16 on CUDA, float32 elsewhere)")
    p.add_argument("--adapters", metavar="DIR", help="adapter folder (default KVBRIDGE_HOME/adapters)")
    p.add_argument("--default-adapter", metavar="NAME", help="adapter to load at start (default: newest matching)")
    p.add_argument("--fit-adapter", action="store_true",
                   help="fit a ridge adapter at start if the folder has none for the pair (about a minute)")
    p.add_argument("--store-device", default=None, help="device of the block pool (default: cuda when present)")
    p.add_argument("--store-capacity-mb", type=float, default=None, help="block pool size (default: half the free "
                                                                          "memory)")
    p.add_argument("--cpu-tier-mb", type=float, default=None, help="CPU tier under the pool (default 0: none)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per block (default 16)")
    p.add_argument("--redis-url",
                   help="Redis/Valkey tier shared by replicas: one server, e.g. redis://127.0.0.1:6379/0, or a Redis "
                        "Cluster, redis+cluster://[user:password@]host:port[,host:port...] (rediss+cluster:// for "
                        "TLS; one reachable node is enough). On a cluster a write counts once a replica confirms it "
                        "(WAIT); ?wait_replicas=N (default 1, 0: the primary's answer) and ?wait_timeout_ms=T "
                        "(default 250) change that")
    p.add_argument("--redis-secret-file", metavar="PATH",
                   help="file holding the secret the replicas sign and check Redis values with: at least 32 bytes "
                        "(e.g. `openssl rand -hex 32`), mode 600 or 640 (default: $KVBRIDGE_REDIS_SECRET_FILE). "
                        "A Redis tier needs one, or --redis-insecure")
    p.add_argument("--redis-insecure", action="store_true",
                   help="a Redis tier without a secret: whoever can write to that Redis can plant KV and entry "
                        "records for any tenant (a warning is logged)")
    p.add_argument("--default-ttl-s", type=float, default=None, help="TTL of entries stored without one")
    p.add_argument("--listen", default=None, help="host:port (default 127.0.0.1:50051; port 0 picks a free one)")
    p.add_argument("--allow-remote-without-tokens", action="store_true",
                   help="let a server without --token-file listen on a non-loopback address")
    p.add_argument("--tls-cert", help="PEM certificate chain (TLS only, with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--token-file", help="'tenant token' lines: bearer tokens and their tenants")
    p.add_argument("--max-message-mb", type=float, default=None, help="largest gRPC message (default 8)")
    p.add_argument("--chunk-kb", type=int, default=None, help="KV chunk size on the wire (default 1024)")
    p.add_argument("--workers", type=int, default=None, help="threads for unary calls (default 8)")
    p.add_argument("--stream-workers", type=int, default=None, help="threads for streamed calls (default 8)")
    p.add_argument("--stream-threads-per-tenant", type=int, default=None,
                   help="streamed calls one tenant runs at once, its others waiting their turn (default: all the "
                        "stream threads with one tenant, else all but a quarter)")
    p.add_argument("--uploads-per-tenant", type=int, default=None,
                   help="open PutSourceKV calls one tenant may hold (default 2)")
    p.add_argument("--stream-idle-s", type=float, default=None,
                   help="cancel a stream that moves no message for this long (default 60)")
    p.add_argument("--max-projections", type=int, default=None, help="projections running at once (default 2)")
    p.add_argument("--correction", default=None,
                   help="what a projected fetch that names no mode gets: replace, recompute:R or blend:R (default "
                        "blend:0.1: computed with the target once per entry, stored, served from the store after)")
    p.add_argument("--max-corrections", type=int, default=None, help="corrections computed at once (default 1)")
    p.add_argument("--no-correction-prior", action="store_true",
                   help="corrections recompute without the target's induction prior")
    p.add_argument("--correction-prior-file", metavar="FILE", default=None,
                   help="the induction prior corrections read for the target it was fitted for (`kvbridge prior fit "
                        "--adapter ADAPTER --out FILE`; default: the one that ships for the target)")
    p.add_argument("--tenant-max-entries", type=int, default=None, help="entries one tenant may hold (default 100000)")
    p.add_argument("--tenant-max-pinned-mb", type=float, default=None,
                   help="pinned KV one tenant may hold (default: a quarter of --store-capacity-mb)")
    p.add_argument("--shm-dir", help="same-host fetches: KV through a private folder made here (default /dev/shm)")
    p.add_argument("--no-shm", action="store_true", help="no same-host data plane: every fetch is streamed")
    p.add_argument("--shm-ttl-s", type=float, default=None,
                   help="remove a shared-memory segment never released after this long (default 30)")
    p.add_argument("--shm-max-mb", type=float, default=None,
                   help="live shared-memory segments hold at most this much; then fetches stream (default 4096)")
    p.add_argument("--shm-keep-s", type=float, default=None,
                   help="keep a finished segment this long after its last fetch, so that the next same-host fetch "
                        "of the same KV copies nothing (default 30; 0: never)")
    p.add_argument("--shm-headroom-tokens", type=int, default=None,
                   help="token slots left after each row of a same-host segment's KV, where the client writes its "
                        "next tokens instead of copying the cache at its first forward (default 64; 0: none)")
    p.add_argument("--stream-keep-mb", type=float, default=None,
                   help="keep the messages of recent streamed fetches, up to this much, so that the next streamed "
                        "fetch of the same KV sends them again without gathering or encoding (default 256; 0: off)")
    p.add_argument("--stream-keep-s", type=float, default=None,
                   help="a streamed fetch's messages are kept this long after their last use (default 30)")
    p.add_argument("--metrics-listen", help="host:port of a Prometheus /metrics endpoint (default: off)")
    p.add_argument("--grace-s", type=float, default=None, help="shutdown drain time (default 10)")
    p.add_argument("--detector-layers", type=int, nargs="+", default=None,
                   help="layers whose attention entropy Ingest's DETECT_SEGMENTS uses (default: all)")
    p.add_argument("--detector-strict", action="store_true", help="5 positions below 0.75 nats (default 3 below 0.8)")
    p.add_argument("--no-selfcheck", action="store_true",
                   help="skip the start-up self-checks and the warm-up of served corrections (not for production)")
    p.add_argument("--log-json", action="store_true", help="structured logs: one JSON object per line")
    p.add_argument("--ready-file", help="write the bound address as JSON here once serving (for scripts)")
    p.set_defaults(func=cmd_serve)
