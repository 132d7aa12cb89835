"""A run from start to end: its spec (spec), the loop (loop) and its steps (steps), rollouts that
overlap the update (overlap), the sampler a run rolls out with (sampler), evaluation, progress and
the learning signal; an ART client's trajectory groups trained as a job (art_step, art_groups,
art_tokens)."""
