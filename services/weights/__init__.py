"""Moving the policy's weights from the learner into rollout engines: the transports and their config
(`transport`, `config`), payload files and checks, shared-memory staging, and the broadcast over NCCL or gloo
(used by both the learner and rollout; imports neither)."""
