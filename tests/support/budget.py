"""How long the long-running tests run, from the environment: ``make fuzz``
and ``make soak`` raise these; ``make test`` runs the defaults."""
import os

DEFAULT_EXAMPLES = 2000
# Examples per hypothesis property of the compiled core (make fuzz: FUZZ_EXAMPLES, 20000).
EXAMPLES = int(os.environ.get("SBUS_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
# Seconds the hostile clients of the live fuzz run per backend.
LIVE_SECONDS = float(os.environ.get(
    "SBUS_FUZZ_SECONDS", 4 if EXAMPLES <= DEFAULT_EXAMPLES else 30))
# A pytest timeout that grows with the example count (a long make fuzz runs for hours).
FUZZ_TIMEOUT = max(300, int(EXAMPLES * 0.05))
# Seconds of churn in the soak, split between the backends (make soak: 600).
SOAK_SECONDS = float(os.environ.get("SBUS_SOAK_SECONDS", "30"))
