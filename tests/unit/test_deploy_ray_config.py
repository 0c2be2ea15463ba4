"""deploy/ray/serve.yaml is a valid `serve deploy` config (Ray's own schema) whose applications exist and whose
service configs parse with the services' config classes."""

from __future__ import annotations

import importlib

import yaml

from tests.conftest import REPO_ROOT

SERVE_CONFIG = REPO_ROOT / "deploy" / "ray" / "serve.yaml"


def load_serve_config():
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema.model_validate(yaml.safe_load(SERVE_CONFIG.read_text()))


def test_serve_config_passes_rays_schema_and_names_every_service():
    schema = load_serve_config()
    assert [app.name for app in schema.applications] == ["rlep-rollout", "rlep-verifier", "rlep-eval"]
    # RLEP's services speak their own gRPC / REST from inside the replicas: no Serve HTTP routes.
    assert all(app.route_prefix is None for app in schema.applications)


def test_every_import_path_is_an_app_builder_that_accepts_its_args():
    from rlep.services.eval.config import EvalConfig
    from rlep.services.eval.ray_app import EvalReplica
    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.ray_app import RolloutReplica
    from rlep.services.verifier.config import VerifierConfig
    from rlep.services.verifier.ray_app import VerifierReplica

    classes = {"rlep-rollout": RolloutConfig, "rlep-verifier": VerifierConfig, "rlep-eval": EvalConfig}
    # (deployment, replicas, CPUs per replica) as serve.yaml asks: one replica each, the verifier's reserving a CPU
    # per verify worker (num_workers: 2).
    expected = {
        "rlep-rollout": (RolloutReplica, 1, 1),
        "rlep-verifier": (VerifierReplica, 1, 2),
        "rlep-eval": (EvalReplica, 1, 1),
    }
    for app in load_serve_config().applications:
        # Building binds the deployment graph without starting Ray: a bad config raises here.
        bound = builder_of(app)(app.args)._bound_deployment
        deployment, replicas, cpus = expected[app.name]
        assert bound.func_or_class is deployment.func_or_class and bound.name == deployment.name, app.name
        assert bound._deployment_config.num_replicas == replicas, app.name
        assert bound._replica_config.ray_actor_options["num_cpus"] == cpus, app.name
        if app.name != "rlep-eval":  # eval's rollout addresses come from the registry at replica start
            classes[app.name].model_validate(app.args["config"])
            assert_within(app.args["config"], bound.init_args[0], app.name)  # every setting serve.yaml gives
    # Eval's replica gets serve.yaml's config with a placeholder for the rollout addresses, and the app to look up.
    [eval_app] = [app for app in load_serve_config().applications if app.name == "rlep-eval"]
    eval_config, rollout_app = builder_of(eval_app)(eval_app.args)._bound_deployment.init_args
    assert eval_config == {**eval_app.args["config"], "rollout": {"addresses": ["registry:0"]}}
    assert rollout_app == "rlep-rollout"
    EvalConfig.model_validate(eval_config)


def assert_within(given: dict, passed: dict, path: str) -> None:
    """Every value set in `given` reaches `passed` unchanged (which may hold defaults besides)."""
    for key, value in given.items():
        if isinstance(value, dict):
            assert_within(value, passed[key], f"{path}.{key}")
        else:
            assert passed[key] == value, f"{path}.{key}"


def builder_of(app):
    module, attr = app.import_path.split(":")
    return getattr(importlib.import_module(module), attr)


def test_eval_reads_rollout_addresses_from_the_rollout_apps_registry():
    apps = {app.name: app for app in load_serve_config().applications}
    assert apps["rlep-eval"].args["rollout_app"] == apps["rlep-rollout"].args["app_name"]
    verifier = apps["rlep-verifier"].args["config"]["server"]
    assert apps["rlep-eval"].args["config"]["verifier"]["address"] == f"{verifier['host']}:{verifier['port']}"


def test_rollout_replicas_spread_over_nodes_when_asked():
    """`local.rollout_max_per_node` (and serve.yaml's `max_per_node`) reach Serve as max_replicas_per_node."""
    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.ray_app import app_builder, build_app

    def per_node(app) -> int | None:
        return app._bound_deployment._replica_config.max_replicas_per_node  # what Serve's scheduler reads

    assert per_node(build_app(RolloutConfig(), num_replicas=2, max_per_node=1)) == 1
    assert per_node(build_app(RolloutConfig(), num_replicas=2)) is None
    assert per_node(app_builder({"num_replicas": 2, "max_per_node": 1})) == 1


def test_rollout_replicas_ask_ray_for_their_gpus():
    """A replica that asks for no GPU sees every GPU and starts vLLM on GPU 0, beside the learner's rank 0."""
    from rlep.services.rollout.config import RolloutConfig
    from rlep.services.rollout.ray_app import app_builder, build_app

    def actor_options(app) -> dict:
        return app._bound_deployment.ray_actor_options  # what Ray schedules each replica with

    assert actor_options(build_app(RolloutConfig(), num_replicas=2, num_gpus=2))["num_gpus"] == 2
    assert actor_options(build_app(RolloutConfig()))["num_gpus"] == 0  # CPU machines: none asked
    assert actor_options(app_builder({"num_replicas": 2, "num_gpus": 1}))["num_gpus"] == 1
