"""mlcc.runtime.spec: speculative decoding: configuration, n-gram and draft-model proposals, acceptance."""
