"""mlcc serve --ray: the OpenAI server scaled out over Ray Serve replicas with prefix-aware routing."""
