"""The checkpoint playground's path to the gateway for a signed-in person (no API key).

An async view, so a streamed completion is relayed chunk by chunk like ``/v1/chat/completions``
itself. It is not CSRF-exempt: the page sends the CSRF token in ``X-CSRFToken``. The team is the
session's current team; the gateway resolves the model id within that team only.
"""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.http import HttpRequest, JsonResponse
from django.http.response import HttpResponseBase
from django.views.decorators.http import require_POST

from frontend.access import session_access
from projects.gateway.sync_servers import serve
from projects.gateway.views import chat_completions_for_team


@require_POST
async def playground_chat(request: HttpRequest) -> HttpResponseBase:
    user = await request.auser()
    if not user.is_authenticated:
        return JsonResponse({"error": {"message": "Sign in first.", "code": "not_signed_in"}}, status=401)
    request.user = user
    access = await sync_to_async(session_access)(request)
    if access is None:
        return JsonResponse({"error": {"message": "You are in no team.", "code": "no_team"}}, status=403)
    return await serve(request, chat_completions_for_team(team=access.team, raw_body=request.body))
