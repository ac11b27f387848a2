"""``benchmarks.provenance``: every results JSON names its commit, command, machine and versions."""

from __future__ import annotations

import json

import pytest

from benchmarks.provenance import provenance, write_result


def test_write_result_records_provenance_and_merges_a_machine_dict(tmp_path):
    path = write_result(tmp_path / "sub" / "r.json", {"rows": [1, 2], "machine": {"backend": "cpu", "cpus": -1}},
                        config={"steps": 3})
    r = json.loads(path.read_text())
    assert r["rows"] == [1, 2] and r["config"] == {"steps": 3}
    assert len(r["commit"]) == 40 and isinstance(r["dirty"], bool) and r["command"].startswith("python -m ")
    m = r["machine"]
    assert m["backend"] == "cpu"  # the benchmark's own entry is kept ...
    assert m["cpus"] >= 1  # ... and provenance's wins a clash
    assert {"cpu_model", "memory_gib", "jax", "jaxlib", "devices", "python"} <= set(m)
    assert r["date"].endswith("+00:00")


def test_a_clash_with_a_provenance_field_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="'commit' is provenance's"):
        write_result(tmp_path / "r.json", {"commit": "abc"})
    assert "config" not in provenance()


def test_results_are_named_bench_device_variant(monkeypatch):
    from benchmarks.provenance import ROOT, device_name, gpu_model, result_path

    assert [gpu_model(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "Tesla V100-SXM2-16GB",
                                   "NVIDIA A100-SXM4-40GB", "Some Accelerator")] == ["h100", "h200", "v100", "a100", "gpu"]
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # pinned to the CPU: no accelerator is asked about
    assert device_name() == "cpu"
    assert result_path("serve") == ROOT / "benchmarks" / "results" / "serve_cpu.json"
    assert result_path("proxy_learning", "tools").name == "proxy_learning_cpu_tools.json"


def test_a_tree_without_git_takes_its_commit_from_the_environment(monkeypatch):
    """A lent GPU machine gets the working tree without ``.git``: the commit it was copied from
    comes from ``$JAXPRM_COMMIT`` (``benchmarks/lent_gpu_prepare.sh``), cleanliness unknown."""
    import benchmarks.provenance as prov

    monkeypatch.setattr(prov, "git", lambda *args: "")
    monkeypatch.delenv(prov.COMMIT_ENV, raising=False)
    assert prov.provenance()["commit"] is None
    monkeypatch.setenv(prov.COMMIT_ENV, "0123abcd" * 5 + "\n")
    r = prov.provenance()
    assert r["commit"] == "0123abcd" * 5 and r["dirty"] is None
