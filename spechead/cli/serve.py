"""``spechead serve``: its options and the command that runs the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import logging
import socket

from spechead.cli.args import add_drafter, add_head, add_max_len, add_target, add_threads, add_tree, port_number
from spechead.errors import SpecheadError
from spechead.serve.app import build_worker, create_app


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; the worker thread is closed either way so that waiting requests get an answer."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_listen(args.host, args.port)  # a taken port fails now, not after the target loads and the tree is tuned
    worker = build_worker(args)
    print(
        f"[spechead] serving {worker.model_name} (drafter {args.drafter}, head {args.head}) on "
        f"http://{args.host}:{args.port}/v1  queue {args.queue_size}, batch {args.max_batch}, "
        f"time limit {args.timeout:g} s",
        flush=True,
    )
    config = uvicorn.Config(
        create_app(worker), host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    try:
        uvicorn.Server(config).run()
    finally:
        worker.close()
    return 0


def check_listen(host: str, port: int) -> None:
    """Refuse an address this process cannot listen on (in use, not local); uvicorn binds it again later."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
            s.bind(addr)
    except OSError as e:
        raise SpecheadError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def add_cli(sub) -> None:
    """Add ``serve`` to the ``spechead`` subcommands."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, streaming, metrics)")
    add_target(s)
    add_drafter(s)
    add_head(s, help="default draft head (a request may pick another)")
    add_tree(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port_number, default=8000)
    s.add_argument("--queue-size", type=int, default=16, help="requests that may wait while others decode")
    s.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="requests decoded together (continuous batching; 1: one at a time, the others wait)",
    )
    s.add_argument("--timeout", type=float, default=300.0, help="per-request time limit in seconds, from arrival")
    s.add_argument("--max-tokens", type=int, default=512, help="max_tokens when a request gives none")
    add_max_len(s)
    s.add_argument("--served-model-name", default=None, help="model id clients use (default: the target's name)")
    add_threads(s)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)
