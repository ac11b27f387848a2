"""``/update_weights_from_disk`` loads only from the configured weights roots, never says whether a
path exists, refuses presets, and accepts only sane, non-decreasing weight versions; an empty API
key is an error rather than "no auth"."""

from __future__ import annotations

import os

import httpx
import jax
import numpy as np
import pytest

from jaxprm.serve import ServerHandle
from jaxprm.serve.serving import ServeConfig
from jaxprm.serve.weights import LOAD_FAILED, MAX_WEIGHT_VERSION

KEY = "k3y"


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny):
    """A weights root holding a saved (perturbed) checkpoint, a directory that is not one, and a
    secret file next to the root."""
    from flax import nnx

    from jaxprm.models import save_pretrained

    base = tmp_path_factory.mktemp("weights")
    (base / "secret.txt").write_text("not for the server")
    root = base / "root"
    (root / "not-a-checkpoint").mkdir(parents=True)
    model, tok = tiny
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: x + 0.01 * rng.standard_normal(x.shape).astype(x.dtype), state)
    save_pretrained(nnx.merge(graphdef, state), tok, root / "ckpt")
    return root


@pytest.fixture(scope="module")
def guarded(server, tiny, root):
    with ServerHandle.from_sampler(server.sampler, tiny[1], model_name="tiny", api_key=KEY,
                                   weights_roots=(str(root),)) as h:
        with httpx.Client(base_url=h.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
            yield h, c


def _update(c: httpx.Client, path: str, **extra):
    return c.post("/update_weights_from_disk", json={"model_path": path, **extra})


def test_paths_outside_the_roots_and_presets_are_refused_without_probing(guarded, root):
    h, c = guarded
    v0 = h.weight_version
    outside = [str(root / ".." / "secret.txt"), str(root / ".." / ".." / ".." / "etc"), str(root.parent),
               "/etc/passwd", "/nonexistent/dir"]
    answers = [_update(c, p) for p in outside]
    assert {r.status_code for r in answers} == {403}
    assert len({r.json()["error"]["message"] for r in answers}) == 1  # existing or not: the same words
    assert all("secret" not in r.text and "etc" not in r.text for r in answers)
    for bad, needle in (("tiny", "preset"), ("smollm2-135m", "preset"), ("ckpt", "absolute"),
                        ("../root/ckpt", "absolute")):
        r = _update(c, bad)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    # inside the root: a missing path and a directory that is not a checkpoint get one message
    missing, invalid = _update(c, str(root / "missing")), _update(c, str(root / "not-a-checkpoint"))
    assert missing.status_code == invalid.status_code == 400
    assert missing.json()["message"] == invalid.json()["message"] == LOAD_FAILED
    os.symlink(root.parent / "secret.txt", root / "link")  # a link out of the root is outside
    assert _update(c, str(root / "link")).status_code == 403
    assert h.weight_version == v0 and c.get("/health").status_code == 200


def test_weight_versions_are_integers_in_range_and_never_go_back(guarded, root):
    h, c = guarded
    ckpt = str(root / "ckpt")
    for bad in (-5, 10**23, MAX_WEIGHT_VERSION + 1, 1.5, 2.0, True, "abc", "-1", "1" * 5000):
        r = _update(c, ckpt, weight_version=bad)
        assert r.status_code == 400, (bad, r.text)
        assert "weight_version" in r.json()["error"]["message"]
    v = h.weight_version + 10
    r = _update(c, ckpt, weight_version=v)
    assert r.status_code == 200 and r.json()["weight_version"] == v
    assert _update(c, ckpt, weight_version=str(v)).status_code == 200  # a retried update is idempotent
    r = _update(c, ckpt, weight_version=v - 1)
    assert r.status_code == 409 and "never go back" in r.json()["error"]["message"]
    assert _update(c, ckpt).json()["weight_version"] == v + 1  # no version: the next one
    assert h.weight_version == v + 1


def test_loading_from_disk_is_off_without_roots_and_needs_the_key(server, tiny, root):
    with ServerHandle.from_sampler(server.sampler, tiny[1], model_name="tiny") as h:
        r = httpx.post(h.url + "/update_weights_from_disk", json={"model_path": str(root / "ckpt")}, timeout=60)
        assert r.status_code == 403 and "--weights-root" in r.json()["error"]["message"]
    with ServerHandle.from_sampler(server.sampler, tiny[1], model_name="tiny", api_key=KEY,
                                   weights_roots=(str(root),)) as h:
        r = httpx.post(h.url + "/update_weights_from_disk", json={"model_path": str(root / "ckpt")}, timeout=60)
        assert r.status_code == 401


def test_empty_api_key_and_bad_weights_root_are_errors(tmp_path, capsys, monkeypatch):
    from jaxprm.serve.__main__ import main

    for key in ("", "  "):
        with pytest.raises(ValueError, match="api_key: must not be empty"):
            ServeConfig(api_key=key)
    with pytest.raises(ValueError, match="not a directory"):
        ServeConfig(weights_roots=(str(tmp_path / "missing"),))
    monkeypatch.delenv("JAXPRM_API_KEY", raising=False)
    for args, needle in ((["--api-key", ""], "--api-key"), (["--weights-root", str(tmp_path / "missing")],
                                                             "--weights-root")):
        with pytest.raises(SystemExit) as info:  # refused before the model is loaded
            main(["--model", "tiny", *args])
        assert info.value.code == 2 and needle in capsys.readouterr().err.splitlines()[-1]
    monkeypatch.setenv("JAXPRM_API_KEY", "")
    with pytest.raises(SystemExit) as info:
        main(["--model", "tiny"])
    assert info.value.code == 2 and "JAXPRM_API_KEY" in capsys.readouterr().err
