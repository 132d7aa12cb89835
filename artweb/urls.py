from django.contrib import admin
from django.http import JsonResponse
from django.urls import include, path


def healthz(request):
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("projects.api.urls")),
    # OpenAI-compatible gateway: the standard `openai` client with base_url=".../v1".
    path("v1/", include("projects.gateway.urls")),
    path("healthz", healthz),
    # The dashboard (server-rendered pages) owns every other path.
    path("", include("frontend.urls")),
]
