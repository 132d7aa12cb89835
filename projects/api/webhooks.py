"""``/api/v1/webhooks/``: a team's webhook endpoints and their delivery log (projects.services.webhooks).

Owners write (an endpoint receives the team's events and holds a signing secret); members and
viewers read the endpoints and the log. The secret (``whsec_…``) is returned once, at creation and
at rotation, never again. Events follow OpenAI's event object: ``{id, object: "event", type,
created_at, data}``.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from projects.access import Permission
from projects.api.base import TeamViewSet
from projects.api.serializers import InputSerializer, NoBodyIn
from projects.api.views import _valid
from projects.errors import NotFound
from projects.models import WEBHOOK_EVENT_TYPES, WebhookDelivery, WebhookEndpoint
from projects.secrets import url_public
from projects.services import webhooks


class WebhookIn(InputSerializer):
    name = serializers.CharField(max_length=63)
    url = serializers.CharField(max_length=1000)
    events = serializers.ListField(
        child=serializers.CharField(max_length=40),
        help_text=f"event types ({', '.join(WEBHOOK_EVENT_TYPES)}), '<prefix>.*' or '*'",
    )


class WebhookUpdateIn(InputSerializer):
    url = serializers.CharField(max_length=1000, required=False)
    events = serializers.ListField(child=serializers.CharField(max_length=40), required=False)
    active = serializers.BooleanField(required=False)


class WebhookOut(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()
    url = serializers.SerializerMethodField()

    class Meta:
        model = WebhookEndpoint
        fields = ["id", "object", "name", "url", "events", "active", "created_at"]

    def get_object(self, obj: WebhookEndpoint) -> str:
        return "webhook"

    def get_url(self, obj: WebhookEndpoint) -> str:
        return url_public(obj.url)


class WebhookDeliveryOut(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()

    class Meta:
        model = WebhookDelivery
        fields = [
            "id", "object", "endpoint", "event_id", "event_type", "status", "attempts", "response_status",
            "error", "latency_ms", "next_attempt_at", "created_at", "delivered_at", "payload",
        ]  # fmt: skip

    def get_object(self, obj: WebhookDelivery) -> str:
        return "webhook.delivery"


def _with_secret(endpoint: WebhookEndpoint, secret: str) -> dict[str, Any]:
    return {**WebhookOut(endpoint).data, "secret": secret}


class WebhookViewSet(TeamViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """The team's webhook endpoints. ``POST`` returns the signing secret once (``secret``)."""

    model = WebhookEndpoint
    serializer_class = WebhookOut
    write_permission = Permission.MANAGE

    def list(self, request: Request) -> Response:
        return self.paginated(self.get_queryset(), WebhookOut)

    @extend_schema(request=WebhookIn, responses={201: WebhookOut})
    def create(self, request: Request) -> Response:
        data = _valid(WebhookIn, request.data)
        created = webhooks.webhook_endpoint_create(team=self.team, **data)
        return Response(_with_secret(created.endpoint, created.secret), status=status.HTTP_201_CREATED)

    @extend_schema(request=WebhookUpdateIn, responses=WebhookOut)
    def partial_update(self, request: Request, pk: str) -> Response:
        data = _valid(WebhookUpdateIn, request.data)
        endpoint = webhooks.webhook_endpoint_update(endpoint=self.get_object(), **data)
        return Response(WebhookOut(endpoint).data)

    update = partial_update

    def destroy(self, request: Request, pk: str) -> Response:
        webhooks.webhook_endpoint_delete(endpoint=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=None, responses=WebhookOut)
    @action(detail=True, methods=["post"], url_path="rotate-secret")
    def rotate_secret(self, request: Request, pk: str) -> Response:
        """A new signing secret (returned once); the old one stops signing at once."""
        _valid(NoBodyIn, request.data)
        endpoint = self.get_object()
        return Response(_with_secret(endpoint, webhooks.webhook_secret_rotate(endpoint=endpoint)))

    @extend_schema(request=None, responses={202: WebhookDeliveryOut})
    @action(detail=True, methods=["post"])
    def test(self, request: Request, pk: str) -> Response:
        """Send a ``webhook.test`` event now; poll the delivery for its outcome."""
        _valid(NoBodyIn, request.data)
        delivery = webhooks.webhook_test(endpoint=self.get_object())
        return Response(WebhookDeliveryOut(delivery).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        responses=WebhookDeliveryOut(many=True),
        parameters=[OpenApiParameter("after", int), OpenApiParameter("limit", int)],
    )
    @action(detail=True, methods=["get"])
    def deliveries(self, request: Request, pk: str) -> Response:
        """The endpoint's deliveries, newest first: status, attempts, last response and latency."""
        return self.paginated(self.get_object().deliveries.order_by("-id"), WebhookDeliveryOut)

    @extend_schema(request=None, responses={202: WebhookDeliveryOut})
    @action(detail=True, methods=["post"], url_path=r"deliveries/(?P<delivery_id>\d+)/redeliver")
    def redeliver(self, request: Request, pk: str, delivery_id: str) -> Response:
        """The same event (same id and body) again, as a new delivery."""
        _valid(NoBodyIn, request.data)
        delivery = self.get_object().deliveries.filter(pk=int(delivery_id)).first()
        if delivery is None:
            raise NotFound(f"No delivery {delivery_id} of this webhook.")
        again = webhooks.webhook_redeliver(delivery=delivery)
        return Response(WebhookDeliveryOut(again).data, status=status.HTTP_202_ACCEPTED)
