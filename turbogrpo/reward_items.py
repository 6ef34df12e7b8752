"""What a reward function may return for an item besides a number (its own module: reward functions and the
environments' reward import it without importing the reward machinery)."""


class ItemFailure:
    """A reward function's value for an item it could not score, with the reason (shown in the run's failure
    message instead of the value; the item gets the fallback like a None)."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"ItemFailure({self.reason!r})"
