from django.contrib import admin
from django.http import JsonResponse
from django.urls import include, path

from projects.metrics import metrics_view
from projects.tinker import exports as tinker_exports


def healthz(request):
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("projects.api.urls")),
    # OpenAI-compatible gateway: the standard `openai` client with base_url=".../v1".
    path("v1/", include("projects.gateway.urls")),
    path("tinker/api/v1/", include("projects.tinker.urls")),  # the tinker SDK (projects.tinker)
    # Signed download URLs of Tinker exports (projects.tinker.exports): no key, the signature is it.
    path("tinker/files/<str:token>", tinker_exports.download),
    path("healthz", healthz),
    path("metrics", metrics_view),  # Prometheus, for the operator's token only (projects.metrics)
    # The dashboard (server-rendered pages) owns every other path.
    path("", include("frontend.urls")),
]

# Errors raised outside any view: JSON error objects on /api and /v1, Django's pages elsewhere.
handler400 = "projects.middleware.bad_request"
handler403 = "projects.middleware.permission_denied"
handler404 = "projects.middleware.page_not_found"
handler500 = "projects.middleware.server_error"
