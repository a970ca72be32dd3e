"""Yes/no environment variables, read as Triton reads its own (TRITON_INTERPRET)."""
import os

TRUE_WORDS = ("1", "true", "yes", "on", "y")
FALSE_WORDS = ("0", "false", "no", "off", "n")


def env_flag(name: str, default: bool) -> bool:
    """A yes/no environment variable read as Triton reads its own (TRITON_INTERPRET): 1, true,
    yes, on, y in any case are on; unset or empty is the default; anything else (" 1" too) is off."""
    value = os.environ.get(name, "").lower()   # not stripped: Triton reads " 1" as off
    return default if not value else value in TRUE_WORDS
