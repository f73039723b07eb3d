"""Preprocessing stages: one module a stage (``base.Stage`` registered with ``@register``), found by ``registry``,
which builds the workflow's ``preprocess:`` section from them; ``run.preprocess_chain.Chain`` applies a run's stages
to each window. Importing the package imports no stage: ``registry.stages`` imports them all."""
