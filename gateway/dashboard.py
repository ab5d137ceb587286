"""The operator dashboard on the gateway: ``GET /dashboard`` (one self-contained HTML + JS page, no CDN, no
build step: gateway/static/dashboard.html) and ``GET /dashboard/data`` (its JSON, gateway/dashboard_data.py),
behind the operator credential of ``GET /metrics`` (docs/dashboard.md).

A browser cannot send a bearer header when it navigates, so the page logs in: ``POST /dashboard/login`` with
the operator token in a form field; the answer sets a session cookie (``HttpOnly; SameSite=Strict;
Path=/dashboard``, ``Secure`` on HTTPS) for :data:`SESSION_S` seconds. The cookie is not the token: it is
``<expiry>.<HMAC-SHA256(token, "actorserve-dashboard:" + expiry)>``, so it is stateless (any gateway with the
same token accepts it), expires by itself, and a new token (rotation) voids every session. ``/dashboard/data``
also takes ``Authorization: Bearer <operator token>`` (scripts). API keys are never accepted. Without an
operator token configured the dashboard answers everyone, with the per-tenant panel left out (the token-less
``/metrics`` rule). POSTs carrying an ``Origin`` whose host is not the gateway's own are refused (403).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from importlib import resources
from urllib.parse import urlsplit

import orjson
from aiohttp import web

from gateway.openai_format import ApiError

COOKIE = "actorserve_dashboard"
SESSION_S = 12 * 3600  # a login lasts this long (s)
_PAGE: dict[str, tuple[str, str]] = {}  # "page" -> (HTML, Content-Security-Policy), read once


def session_value(token: str, expires: int) -> str:
    """The session cookie value for ``token`` expiring at ``expires`` (epoch s)."""
    mac = hmac.new(token.encode(), f"actorserve-dashboard:{int(expires)}".encode(), hashlib.sha256).hexdigest()
    return f"{int(expires)}.{mac}"


def session_valid(value: str | None, token: str, now: float) -> bool:
    """Whether a cookie value is a live session of ``token`` at ``now`` (constant-time comparison)."""
    head, _, _ = (value or "").partition(".")
    if not head.isdigit() or int(head) <= now:
        return False
    return hmac.compare_digest(value.encode(), session_value(token, int(head)).encode())


def page() -> tuple[str, str]:
    """(HTML, Content-Security-Policy) of the dashboard page: the policy allows exactly the page's inline
    script and style (their SHA-256) and fetches to the same origin; nothing else loads."""
    if "page" not in _PAGE:
        html = resources.files("gateway").joinpath("static/dashboard.html").read_text(encoding="utf-8")

        def hashes(tag: str) -> str:
            bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
            return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                            for b in bodies)
        csp = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
               "connect-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; "
               "base-uri 'none'")
        _PAGE["page"] = (html, csp)
    return _PAGE["page"]


class Dashboard:
    """The dashboard routes of one gateway. ``feed``: a gateway.dashboard_feed.DashboardFeed;
    ``operator_token``: the token of ``GET /metrics`` (None: no token, open without tenants); ``bearer_ok``:
    ``(Authorization header, token) -> bool``, the check of ``GET /metrics`` (gateway.http.operator_authorized)."""

    def __init__(self, feed, operator_token: str | None, bearer_ok) -> None:
        self.feed, self.token, self.bearer_ok = feed, operator_token, bearer_ok

    def add_routes(self, app: web.Application) -> None:
        """``GET /dashboard``, ``GET /dashboard/data``, ``POST /dashboard/login``, ``POST /dashboard/logout``."""
        app.router.add_get("/dashboard", self.page)
        app.router.add_get("/dashboard/data", self.data)
        app.router.add_post("/dashboard/login", self.login)
        app.router.add_post("/dashboard/logout", self.logout)
        app.on_cleanup.append(lambda _app: self.feed.stop())

    def authorized(self, request: web.Request) -> bool:
        """Operator session cookie or ``Authorization: Bearer <operator token>`` (always True without a token)."""
        if self.token is None:
            return True
        return session_valid(request.cookies.get(COOKIE), self.token, time.time()) or \
            self.bearer_ok(request.headers.get("Authorization"), self.token)

    async def page(self, request: web.Request) -> web.Response:
        """The page (200) once logged in; else the same page at 401, which shows its login form."""
        html, csp = page()
        status = 200 if self.authorized(request) else 401
        return web.Response(text=html, status=status, content_type="text/html", charset="utf-8",
                            headers=_headers(csp))

    async def data(self, request: web.Request) -> web.Response:
        """The dashboard JSON (gateway/dashboard_data.py ``build_snapshot``); 401 without the credential."""
        if not self.authorized(request):
            return _error(_unauthorized(), {"WWW-Authenticate": "Bearer"})
        snap = await self.feed.snapshot(show_tenants=self.token is not None)
        return web.json_response(snap, headers=_headers(None))

    async def login(self, request: web.Request) -> web.Response:
        """``POST /dashboard/login`` (form field ``token``): 303 to /dashboard with the session cookie; 401 for a
        wrong token (API keys included); 403 for a foreign Origin; 400 without a token configured."""
        if not _same_origin(request):
            return _error(ApiError(403, "cross-origin login refused", code="forbidden_origin"))
        if self.token is None:
            return _error(ApiError(400, "this gateway has no operator token: the dashboard needs no login",
                                   param="token", code="no_operator_token"))
        try:
            form = await request.post()
        except (UnicodeDecodeError, LookupError, ValueError):  # not UTF-8, an unknown charset, a broken body
            return _error(ApiError(400, "the login form could not be read: send token=<operator token> as "
                                   "application/x-www-form-urlencoded UTF-8", param="token", code="invalid_form"))
        given = str(form.get("token") or "").strip()
        if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
            return _error(_unauthorized())
        resp = web.Response(status=303, headers={"Location": "/dashboard", **_headers(None)})
        resp.set_cookie(COOKIE, session_value(self.token, int(time.time()) + SESSION_S), max_age=SESSION_S,
                        path="/dashboard", httponly=True, samesite="Strict", secure=request.secure)
        return resp

    async def logout(self, request: web.Request) -> web.Response:
        """``POST /dashboard/logout``: clears the cookie, 303 to /dashboard."""
        if not _same_origin(request):
            return _error(ApiError(403, "cross-origin logout refused", code="forbidden_origin"))
        resp = web.Response(status=303, headers={"Location": "/dashboard", **_headers(None)})
        resp.del_cookie(COOKIE, path="/dashboard")
        return resp


def _unauthorized() -> ApiError:
    """The 401 of the dashboard without the operator credential (the code of ``GET /metrics``'s)."""
    return ApiError(401, "the dashboard needs the operator token: log in at /dashboard with the token of "
                    "<state-dir>/operator-token, or send Authorization: Bearer <token> (API keys are not accepted)",
                    code="invalid_operator_token")


def _error(err: ApiError, headers: dict | None = None) -> web.Response:
    """The OpenAI-shaped JSON error, never cached."""
    return web.json_response(err.body(), status=err.status, dumps=lambda o: orjson.dumps(o).decode(),
                             headers={**err.http_headers(), **_headers(None), **(headers or {})})


def _same_origin(request: web.Request) -> bool:
    """True without an ``Origin`` header or when its host (``host[:port]``) is this gateway's own ``Host``; the
    scheme is not compared, so a proxy that terminates TLS in front of the gateway does not lock the form out."""
    origin = request.headers.get("Origin")
    return origin is None or urlsplit(origin).netloc == request.host


def _headers(csp: str | None) -> dict[str, str]:
    h = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
         "X-Frame-Options": "DENY"}
    if csp:
        h["Content-Security-Policy"] = csp
    return h
