"""The Tinker API's ``tinker://`` paths: resolved by the domain's read (projects.selectors.tinker_paths,
which the Tinker jobs and services share), named here as the API's own."""

from __future__ import annotations

from projects.selectors.tinker_paths import SCHEME, checkpoint_for_path, is_public, name_expiry

__all__ = ["SCHEME", "checkpoint_for_path", "is_public", "name_expiry"]
