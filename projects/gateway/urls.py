from django.urls import path

from projects.gateway import views

urlpatterns = [
    path("chat/completions", views.chat_completions, name="gateway-chat-completions"),
    path("models", views.models, name="gateway-models"),
    path("models/<path:model_id>", views.model_detail, name="gateway-model"),
]
