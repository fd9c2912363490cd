"""The CheckpointConfiguration controller: ``kubectl apply`` a configuration and its node stack
is made, rolled on edits, removed on delete, and its status says how the nodes are.

``plan`` decides (pure: a configuration in, objects, refusals and status out, rendered by
``mtc render``'s own code), ``kube`` applies through the Kubernetes API, ``handlers`` wires
both to kopf, ``leader`` keeps one replica active, ``main`` is ``mtc-controller``.
"""
