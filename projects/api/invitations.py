"""Invitations: joining a team needs the invitee's consent.

Owners list, create and revoke a team's invitations (``/api/v1/invitations/``); whoever holds the
token accepts it while signed in (``POST /api/v1/invitations/accept``), which is not team-scoped
(the person is not a member yet) and so derives from ``SignedInViewSet``.
"""

from __future__ import annotations

from urllib.parse import urlencode

from django.db.models import QuerySet
from django.urls import reverse
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from projects import selectors, services
from projects.access import Permission
from projects.api.base import SignedInViewSet, TeamViewSet
from projects.api.serializers import InputSerializer
from projects.api.views import _user, _valid
from projects.models import Invitation, Role


class InvitationOut(serializers.ModelSerializer):
    created_by = serializers.CharField(
        source="created_by.username", default=None, allow_null=True, read_only=True
    )

    class Meta:
        model = Invitation
        fields = [
            "id",
            "invitee",
            "role",
            "created_by",
            "created_at",
            "expires_at",
            "accepted_at",
            "revoked_at",
        ]


class InvitationCreatedOut(InvitationOut):
    token = serializers.CharField(help_text="shown only this once")
    accept_url = serializers.CharField(help_text="the dashboard page where the invitee accepts")

    class Meta(InvitationOut.Meta):
        fields = [*InvitationOut.Meta.fields, "token", "accept_url"]


class InvitationIn(InputSerializer):
    invitee = serializers.CharField(max_length=254, help_text="email or username, kept as typed")
    role = serializers.ChoiceField(choices=Role.choices, required=False, default=Role.MEMBER)


class InvitationAcceptIn(InputSerializer):
    token = serializers.CharField(max_length=200)


class InvitationAcceptedOut(serializers.Serializer):
    team = serializers.CharField()
    role = serializers.CharField()
    membership_id = serializers.IntegerField()


def accept_url(request: Request, token: str) -> str:
    return request.build_absolute_uri(
        f"{reverse('frontend:invitation-accept')}?{urlencode({'token': token})}"
    )


class InvitationViewSet(TeamViewSet, mixins.ListModelMixin, mixins.DestroyModelMixin):
    """The team's pending invitations (owners only: they name people). Creating one answers the
    same whether or not the invitee has an account; the token is returned once."""

    model = Invitation
    serializer_class = InvitationOut
    read_permission = Permission.MANAGE
    write_permission = Permission.MANAGE

    def base_queryset(self) -> QuerySet:
        return Invitation.objects.select_related("created_by")

    def list(self, request: Request) -> Response:
        return self.paginated(
            selectors.pending_invitations(team=self.team).select_related("created_by"), InvitationOut
        )

    @extend_schema(request=InvitationIn, responses={201: InvitationCreatedOut})
    def create(self, request: Request) -> Response:
        data = _valid(InvitationIn, request.data)
        created = services.invitation_create(
            team=self.team, invitee=data["invitee"], role=data["role"], by=_user(request)
        )
        body = dict(InvitationOut(created.invitation).data)
        body.update(token=created.token, accept_url=accept_url(request, created.token))
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request: Request, pk: str) -> Response:
        services.invitation_revoke(invitation=self.get_object(), by=_user(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class InvitationAcceptView(SignedInViewSet):
    """Accept an invitation: the signed-in person joins its team with its role. Unknown tokens are
    404; revoked, used or expired ones 400 with a code saying which."""

    serializer_class = InvitationAcceptIn  # what OPTIONS describes

    @extend_schema(request=InvitationAcceptIn, responses={201: InvitationAcceptedOut})
    def create(self, request: Request) -> Response:
        data = _valid(InvitationAcceptIn, request.data)
        user = _user(request)
        assert user is not None, "SignedIn ran first"
        membership = services.invitation_accept(token=data["token"], user=user)
        body = {"team": membership.team.name, "role": membership.role, "membership_id": membership.pk}
        return Response(InvitationAcceptedOut(body).data, status=status.HTTP_201_CREATED)
