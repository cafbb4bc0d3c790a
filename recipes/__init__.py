raise ImportError(
    "recipes/ holds runnable scripts, not a library: run them with `accelerate launch recipes/<name>.py`. "
    "The library (`retrofit`) never imports from recipes."
)
