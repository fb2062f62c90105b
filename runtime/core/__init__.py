"""mlcc.runtime.core: requests, scheduling, sampling and tokenizing, with no device or API knowledge."""
