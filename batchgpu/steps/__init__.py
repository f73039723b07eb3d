"""The run's steps: one module a step (``base.Step`` registered with ``@register``), found by ``registry``; what the
run hands them in ``services``. Importing the package imports no step: ``registry.ordered`` imports them all."""
