"""Stage 2: smaller builds: routed experts pruned (router_sum, reap) or re-encoded in TWX."""
