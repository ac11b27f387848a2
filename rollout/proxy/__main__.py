"""``python -m rollout.proxy --upstream URL [--upstream URL2 ...] --admin-key K --tokenizer SPEC
[--prm-config FILE.yaml] [--host 127.0.0.1] [--port N] ...``: serve the recording proxy until killed.

``--tokenizer`` must match the upstream's model (the proxy tokenizes the chat itself, to keep earlier
turns token-identical): a Hugging Face tokenizer directory, or ``package.module:function`` returning a
tokenizer, e.g. ``jaxprm.models:build_tiny_tokenizer`` for ``python -m jaxprm.serve --model tiny``.
The admin key may also come from the environment variable ``JAXPRM_PROXY_ADMIN_KEY`` (so it is not
visible in the process list). ``--prm-config`` is a YAML file holding the ``prm`` mapping
(``enabled``, ``scorers``, ``advantage_shaping``), at the top level or under a ``prm:`` key.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rollout.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", action="append", required=True, metavar="URL",
                   help="generation server base URL (repeat for several; least-loaded, sticky per session)")
    p.add_argument("--admin-key", default=os.environ.get("JAXPRM_PROXY_ADMIN_KEY"),
                   help="admin key (default: $JAXPRM_PROXY_ADMIN_KEY)")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer directory or package.module:function")
    p.add_argument("--prm-config", metavar="FILE.yaml", help="process-reward scorers (the prm mapping)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dialect", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--upstream-model", default=None, help="the model field sent to a vLLM upstream")
    p.add_argument("--upstream-api-key", default=os.environ.get("JAXPRM_UPSTREAM_API_KEY"))
    p.add_argument("--upstream-timeout", type=float, default=300.0)
    p.add_argument("--upstream-retries", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=256, help="upstream requests in flight at once")
    p.add_argument("--chat-template-type", choices=["concat", "hf"], default="concat")
    p.add_argument("--passthrough", action="store_true", help="forward calls without a known key unrecorded")
    p.add_argument("--model-name", default="jaxprm-proxy")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--max-context-tokens", type=int, default=None)
    p.add_argument("--session-timeout", type=float, default=3600.0, help="seconds before an idle session is swept")
    p.add_argument("--keep-alive", type=float, default=75.0,
                   help="seconds an idle client connection stays open (agents that think longer between turns "
                        "reconnect; a short value makes their reuse of a closing connection likelier)")
    p.add_argument("--log-level", default="warning")
    return p


def load_prm_file(path: str | os.PathLike) -> dict:
    """The ``prm`` mapping from a YAML file (top level, or under ``prm:``)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--prm-config: file not found: {p}")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--prm-config {p}: the top level must be a mapping")
    if "prm" in data:
        data = data["prm"]
    return data


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.admin_key:
        print("error: --admin-key (or JAXPRM_PROXY_ADMIN_KEY) is required", file=sys.stderr)
        return 2
    from rollout.client import ClientConfig
    from rollout.proxy.config import ProxyConfig
    from rollout.proxy.tokenize import load_tokenizer

    bad = [u for u in args.upstream if not u.startswith(("http://", "https://"))]
    if bad:
        print(f"error: --upstream {bad[0]!r} must start with http:// or https://", file=sys.stderr)
        return 2
    try:
        prm = load_prm_file(args.prm_config) if args.prm_config else None
        upstream = ClientConfig(endpoints=tuple(args.upstream), dialect=args.dialect, model=args.upstream_model,
                                api_key=args.upstream_api_key, timeout_s=args.upstream_timeout,
                                max_retries=args.upstream_retries, max_concurrency=args.concurrency)
        config = ProxyConfig(upstream=upstream, admin_key=args.admin_key, chat_template_type=args.chat_template_type,
                             prm=prm, passthrough=args.passthrough, model_name=args.model_name,
                             default_max_tokens=args.default_max_tokens, max_context_tokens=args.max_context_tokens,
                             session_timeout_s=args.session_timeout)
        tokenizer = load_tokenizer(args.tokenizer)
    except (ValueError, TypeError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from rollout.proxy.app import create_app  # imports the learner rows (jax): only once the arguments are good
    from rollout.proxy.service import RecordingProxy

    logging.basicConfig(level=args.log_level.upper())
    app = create_app(RecordingProxy(config, tokenizer))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_keep_alive=int(args.keep_alive), timeout_graceful_shutdown=int(config.drain_timeout_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
