"""Deprecated module name (kept for one release): tree sizing lives in ``turbogrpo.speculative.sizing``;
"policy" names the trained model everywhere else."""

import warnings

from turbogrpo.speculative.sizing import (DEFAULT_K_MAX, DEFAULT_L_MAX, DEFAULT_N_MAX,  # noqa: F401
                                          SIZING_POLICIES, CostSizing, FastGRPOSizing, FixedSizing, OffSizing,
                                          SizingPolicy, acceptance_counts, expected_accepted_table, make_sizing)

warnings.warn("turbogrpo.speculative.policy is deprecated; import turbogrpo.speculative.sizing", DeprecationWarning,
              stacklevel=2)
