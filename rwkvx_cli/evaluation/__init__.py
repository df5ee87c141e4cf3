"""Downstream evaluation: `rwkvx eval --tasks` through lm-evaluation-harness (docs/eval.md).

`scoring` needs only torch; `harness` and `adapter` need the optional `lm_eval` package and
import it only when tasks are run."""
