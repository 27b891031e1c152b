"""Routing: which generator takes each generation call of a trajectory, in the env-host.

One policy per module, each a `Router` (`base`): `by_class` (the paper's: hardware class by the task's
profile, then stickiness and load), `by_finish_time` (where the call is predicted to finish first, with
`spill` moving how often a saturated class's calls may leave it). `rollart.rollout.proxy.LLMProxy`
builds one from `rollout.routing` and sends, re-issues and fails over around it.
"""
