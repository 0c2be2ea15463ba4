"""The sandbox that runs a policy's tool code (issue 50): isolation, limits, fair concurrency and a result cache."""
