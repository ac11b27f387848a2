"""The server's OpenAPI document: the error answers each route really gives, nothing it does not.

FastAPI documents a 422 for every route with a body; this server answers validation errors with
400 in the OpenAI error shape (``jaxprm.serve.errors``), so :func:`install_openapi` drops the 422s
(and their schemas), and each route lists its error statuses with :func:`errors`. With an API key
configured every route but ``/health`` also documents 401 and the bearer scheme. Success bodies
are the response models of ``jaxprm.serve.responses``.
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from jaxprm.serve.errors import ErrorBody

__all__ = ["errors", "install_openapi", "ERROR_DESCRIPTIONS"]

ERROR_DESCRIPTIONS = {
    400: "invalid request: validation (strict types), limits, malformed JSON",
    401: "missing or wrong API key",
    403: "refused: loading weights from this path is not allowed",
    404: "unknown model",
    409: "weight version below the served one",
    413: "request body too large",
    500: "unexpected server error",
    503: "generation engine not running",
    504: "generation timed out",
}


def errors(*statuses: int, **models: Any) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses`` entry for these error statuses (all :class:`ErrorBody`, unless
    ``models`` maps ``"s400"`` etc. to another model)."""
    return {s: {"model": models.get(f"s{s}", ErrorBody), "description": ERROR_DESCRIPTIONS[s]} for s in statuses}


def install_openapi(app: FastAPI, *, api_key: bool, open_paths: tuple[str, ...] = ("/health",)) -> None:
    """Make ``app.openapi()`` the document described in the module docstring (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        with warnings.catch_warnings():  # a route with two methods: one operation id, made unique below
            warnings.filterwarnings("ignore", message="Duplicate Operation ID")
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        unauthorized = {"description": ERROR_DESCRIPTIONS[401],
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                if len(ops) > 1 and "operationId" in op:
                    op["operationId"] = f"{op['operationId'].rsplit('_', 1)[0]}_{method}"
                op.get("responses", {}).pop("422", None)
                if api_key and path not in open_paths:
                    op["responses"]["401"] = unauthorized
                    op["security"] = [{"bearer": []}]
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        if api_key:  # (every route documents a 500, so ErrorBody is among the schemas)
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
