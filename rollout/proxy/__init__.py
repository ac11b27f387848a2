"""The recording proxy (the process-reward spec's v1/v2 data path; ``docs/design.md``, "The recording proxy"), layer 4.

Any agent written against the official ``openai`` SDK talks to the proxy as if it were a model
server (``base_url`` + a session key as ``api_key``). The proxy forwards each chat call token-in /
token-out to the generation server (``rollout.client``: vLLM or SGLang dialect, or the embedded
``jaxprm.serve``), records it, links it to its parent by the longest-prefix rule, keeps earlier
turns token-identical (concat tokenization), and on export turns the recorded sessions into
``jaxprm.Batch``-ready rows, scored by the ``scorers.PRMRunner``.

Modules: ``config`` (``ProxyConfig``, ``ProxyError``), ``sessions`` (records, the parent rule,
rewards, claims, sweeps), ``tokenize`` (concat prompts, tokenizer loading), ``chat`` (OpenAI
request / answer shapes), ``export`` (rows, discount, scoring, ``prm_stats``), ``service``
(``RecordingProxy``: the behaviour as a Python object), ``app`` (FastAPI routes + lifespan),
``server`` (``ProxyServer``: in-process serving), ``workflow`` (the agent contract and one group
run through the proxy), ``__main__`` (``python -m rollout.proxy``).
"""

from rollout.proxy.config import HITL_SESSION, ProxyConfig, ProxyError
from rollout.proxy.export import PRMStats, ProxyRow, prm_stats_metrics, rows_from_json
from rollout.proxy.server import ProxyServer
from rollout.proxy.service import ExportRequest, ExportResult, RecordingProxy

__all__ = [
    "HITL_SESSION",
    "ExportRequest",
    "ExportResult",
    "PRMStats",
    "ProxyConfig",
    "ProxyError",
    "ProxyRow",
    "ProxyServer",
    "RecordingProxy",
    "prm_stats_metrics",
    "rows_from_json",
]
