"""Operator views. Writes that carry business rules (runs, keys) go through the API / services;
the admin is for looking around and for the base-model catalogue."""

from django.contrib import admin

from projects import models


@admin.register(models.Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "created_at"]
    search_fields = ["name"]


@admin.register(models.Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["team", "user", "role"]
    list_filter = ["role"]


@admin.register(models.ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "prefix", "read_only", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["prefix", "key_hash", "created_at", "last_used_at"]


@admin.register(models.Invitation)
class InvitationAdmin(admin.ModelAdmin):
    list_display = ["invitee", "team", "role", "created_at", "expires_at", "accepted_at", "revoked_at"]
    readonly_fields = ["prefix", "token_hash", "created_at", "accepted_at", "accepted_by"]


@admin.register(models.BaseModel)
class BaseModelAdmin(admin.ModelAdmin):
    list_display = ["name", "source"]


@admin.register(models.Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "created_at"]
    list_filter = ["team"]


@admin.register(models.Run)
class RunAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "project",
        "model",
        "status",
        "current_step",
        "total_steps",
        "worker",
        "heartbeat_at",
    ]
    list_filter = ["status"]
    readonly_fields = [field.name for field in models.Run._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(models.RunEvent)
class RunEventAdmin(admin.ModelAdmin):
    list_display = ["run", "created_at", "level", "type", "message"]
    list_filter = ["level", "type"]


@admin.register(models.Evaluation)
class EvaluationAdmin(admin.ModelAdmin):
    list_display = ["id", "project", "run", "step", "checkpoint", "base_model", "status", "created_at"]
    list_filter = ["status"]
    readonly_fields = [field.name for field in models.Evaluation._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(models.EvaluationEvent)
class EvaluationEventAdmin(admin.ModelAdmin):
    list_display = ["evaluation", "created_at", "level", "message"]
    list_filter = ["level"]
