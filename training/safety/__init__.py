"""What keeps a team's input from reaching where it should not: the outbound policy (outbound,
outbound_names, outbound_transport), redaction of secrets in messages (redaction) and the caps on
sandboxes a host runs at once (slots)."""
