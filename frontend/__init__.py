"""The dashboard (server-rendered Django app). Pages arrive with the dashboard issue."""
