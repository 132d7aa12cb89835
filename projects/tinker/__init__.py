"""The Tinker API under ``/tinker/api/v1/``: Thinking Machines' ``tinker`` SDK trains on artweb
unchanged (``ServiceClient(base_url=<artweb>/tinker, api_key="tml-" + <team API key>)``).

``views`` answers the SDK's routes (JSON, and protobuf for ``forward_backward``), ``paths`` reads
``tinker://`` checkpoint paths; the requests run in workers (projects.jobs.tinker).
"""
