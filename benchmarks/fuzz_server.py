"""Schemathesis over the generation server's served OpenAPI document: no server error, and every
answer conforms to the document (status, content type, headers, body schema); a request that
breaks the document's request schema is refused (negative data rejection).

    python -m benchmarks.fuzz_server [--examples 3000] [--seed 19] [--json PATH] [--url URL]

starts ``python -m jaxprm.serve``'s app for the tiny model in-process on a free loopback port
(unless ``--url`` names a running server), generates ``--examples`` cases over all operations
(schemathesis' positive and negative modes, no shrinking; an operation the draw left out gets 5
cases of its own), and writes a JSON report: cases,
statuses (overall and per operation), server errors, check failures, wall time, load average.
Exits 1 on any server error or failure. ``tests/serve/test_openapi.py`` runs :func:`fuzz` with a
small budget in the default suite.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Any

from benchmarks.provenance import result_path, write_result

__all__ = ["fuzz", "main"]


def fuzz(url: str, *, max_examples: int, seed: int = 0, headers: dict[str, str] | None = None,
         timeout_s: float = 120.0) -> dict[str, Any]:
    """Run ``max_examples`` schemathesis cases against the server at ``url``; returns the report
    (``cases``, ``statuses``, ``operations`` {"METHOD /path": {status: count}}, ``server_errors``,
    ``failures`` [first lines of each failed check], ``wall_s``). A successful ``/pause_generation``
    is followed by ``/continue_generation`` at once, so that later cases are served."""
    import hypothesis
    import hypothesis.strategies as st
    import requests
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                                   response_headers_conformance, response_schema_conformance,
                                                   status_code_conformance)

    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=headers or {})
    strategy = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
              response_schema_conformance, negative_data_rejection]
    statuses: collections.Counter = collections.Counter()
    per_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    session = requests.Session()
    t0 = time.perf_counter()

    settings = hypothesis.settings(max_examples=max_examples, deadline=None, database=None, print_blob=False,
                                   phases=[hypothesis.Phase.generate],
                                   suppress_health_check=list(hypothesis.HealthCheck))

    def check(case):
        name = f"{case.operation.method.upper()} {case.operation.path}"
        response = case.call(base_url=url, session=session, headers=headers, timeout=timeout_s)
        statuses[str(response.status_code)] += 1
        per_op[name][str(response.status_code)] += 1
        if case.operation.path == "/pause_generation" and response.status_code == 200:
            session.post(url + "/continue_generation", headers=headers, timeout=timeout_s).raise_for_status()
        try:
            case.validate_response(response, checks=checks, headers=headers)
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis' FailureGroup: recorded, the run goes on
            first = str(exc).strip().splitlines()
            failures.append(f"{name} -> {response.status_code}: {' | '.join(first[:6])}"[:600])

    settings(hypothesis.seed(seed)(hypothesis.given(case=strategy)(check)))()
    for operation in (r.ok() for r in schema.get_all_operations()):  # one the draw left out gets a few cases
        if f"{operation.method.upper()} {operation.path}" not in per_op:
            alone = st.one_of(operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
                              operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
            hypothesis.settings(settings, max_examples=5)(hypothesis.seed(seed)(hypothesis.given(case=alone)(check)))()
    return {"cases": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
            "operations": {k: dict(sorted(v.items())) for k, v in sorted(per_op.items())},
            "server_errors": sum(n for s, n in statuses.items() if s.startswith("5")),
            "failures": failures, "wall_s": round(time.perf_counter() - t0, 1)}


def _table(report: dict[str, Any]) -> str:
    lines = [f"{'operation':<34} {'cases':>6}  statuses"]
    for op, st in report["operations"].items():
        lines.append(f"{op:<34} {sum(st.values()):>6}  " + ", ".join(f"{s}: {n}" for s, n in st.items()))
    lines.append(f"{'all':<34} {report['cases']:>6}  " + ", ".join(f"{s}: {n}" for s, n in report["statuses"].items()))
    lines.append(f"server errors: {report['server_errors']}   check failures: {len(report['failures'])}   "
                 f"wall: {report['wall_s']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=3000, help="cases to generate (all operations together)")
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--url", default=None, help="fuzz a running server instead of starting the tiny one")
    p.add_argument("--json", default=None, help="where to write the report (default: benchmarks/results/fuzz_server_<device>.json)")
    args = p.parse_args(argv)
    args.json = args.json or result_path("fuzz_server")
    handle = None
    url = args.url
    if url is None:
        from jaxprm.models import load_model
        from jaxprm.serve import ServerHandle

        model, tok = load_model("tiny")
        handle = ServerHandle.start(model, tok, model_name="tiny", kv_cache_tokens=65536)
        url = handle.url
    load_start = os.getloadavg()
    try:
        report = fuzz(url, max_examples=args.examples, seed=args.seed)
    finally:
        if handle is not None:
            handle.stop()
    report.update(examples=args.examples, seed=args.seed, loadavg_start=list(load_start),
                  loadavg_end=list(os.getloadavg()))
    print(_table(report))
    for f in report["failures"][:20]:
        print("FAILURE", f)
    if args.json:
        write_result(args.json, report)
    return 1 if report["server_errors"] or report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
