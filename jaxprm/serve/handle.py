"""In-process server handle: run the generation server in a background thread of the trainer.

    server = ServerHandle.start(model, tokenizer, host="127.0.0.1", port=0)
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    ...
    server.update_weights(new_params)   # in-process swap, bumps the weight version
    server.stop()
"""

from __future__ import annotations

from typing import Any

from jaxprm.inprocess import ThreadedServer
from jaxprm.serve.sampler import Sampler
from jaxprm.serve.app import create_app
from jaxprm.serve.serving import ServeConfig

__all__ = ["ServerHandle"]


class ServerHandle:
    """A running server (uvicorn in a daemon thread) and the sampler behind it.

    Use ``ServerHandle.start`` (from a model) or ``ServerHandle.from_sampler``; ``url`` is the bound
    ``http://host:port`` and ``base_url`` the OpenAI base (``url + "/v1"``). Also a context manager.
    """

    def __init__(self, sampler: Sampler, tokenizer, config: ServeConfig, *, host: str, port: int,
                 load_fn=None, startup_timeout_s: float = 60.0, log_level: str = "warning"):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.config = config
        self.app = create_app(sampler, tokenizer, config, load_fn=load_fn)
        self._load_fn, self._startup_timeout_s, self._log_level = load_fn, startup_timeout_s, log_level
        self._http = ThreadedServer(self.app, host=host, port=port, name="jaxprm-serve", lifespan="on",
                                    log_level=log_level, access_log=True, startup_timeout_s=startup_timeout_s)
        self.host, self.port, self.url = host, self._http.port, self._http.url

    @classmethod
    def start(cls, model, tokenizer, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "jaxprm",
              api_key: str | None = None, config: ServeConfig | None = None, sampler_kwargs: dict[str, Any] | None = None,
              load_fn=None, **config_overrides) -> ServerHandle:
        """Build a ``Sampler`` for ``model`` and serve it; ``port=0`` picks a free port.

        ``sampler_kwargs`` go to ``Sampler`` (defaults: the tokenizer's EOS and pad ids);
        ``config_overrides`` set ``ServeConfig`` fields.
        """
        kw = dict(eos_token_ids=tuple(tokenizer.eos_token_ids), pad_token_id=tokenizer.pad_token_id or 0)
        kw.update(sampler_kwargs or {})
        sampler = Sampler(model, **kw)
        return cls.from_sampler(sampler, tokenizer, host=host, port=port, model_name=model_name, api_key=api_key,
                                config=config, load_fn=load_fn, **config_overrides)

    @classmethod
    def from_sampler(cls, sampler: Sampler, tokenizer, *, host: str = "127.0.0.1", port: int = 0,
                     model_name: str = "jaxprm", api_key: str | None = None, config: ServeConfig | None = None,
                     load_fn=None, **config_overrides) -> ServerHandle:
        """Serve an existing ``Sampler`` (e.g. one the trainer also calls directly)."""
        if config is None:
            config = ServeConfig(model_name=model_name, api_key=api_key, **config_overrides)
        return cls(sampler, tokenizer, config, host=host, port=port, load_fn=load_fn)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def engine(self):
        """The server's generation ``Engine`` (stats, pause / resume, prefix cache)."""
        return self.app.state.server.engine

    @property
    def weight_version(self) -> int:
        return self.sampler.weight_version

    def update_weights(self, params, *, version: int | None = None) -> int:
        """Swap the served weights in-process (model, ``nnx.State`` or pure dict); returns the version.

        The engine applies them at its next step boundary: running requests continue with the new
        weights (each output token records its version in ``output_token_versions``), the prefix
        cache is flushed. Pause the engine first (``/pause_generation``) to keep versions apart.
        """
        return self.sampler.update_params(params, version=version)

    @property
    def alive(self) -> bool:
        """Its HTTP server runs and its engine too (``/health`` answers 200)."""
        return self._http.alive and self.engine.running

    def restarted(self) -> ServerHandle:
        """Stop this server (whatever is left of it, open connections dropped) and serve the same
        sampler -- its weights and weight version, its compiled programs -- again on the same host
        and port, with a new engine (an empty KV pool and prefix cache). Returns the new handle."""
        self._http.stop(timeout=10.0, force=True)
        self.engine.stop()  # normally stopped by the app's shutdown already; never two engines on one sampler
        return ServerHandle(self.sampler, self.tokenizer, self.config, host=self.host, port=self.port,
                            load_fn=self._load_fn, startup_timeout_s=self._startup_timeout_s,
                            log_level=self._log_level)

    def stop(self, timeout: float = 30.0) -> None:
        """Shut the server down (idempotent); the engine stops with it."""
        self._http.stop(timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
