"""A job's ranks working together: the coordinator, restore rounds and steady state.

Messages in our own types and their checks (``messages``), the coordinators this daemon
hosts (``hosting``), their calls in our own types (``coordinators``) and over gRPC
(``coordinator_servicer``), the agent's client (``coordinator_client``) and the link that
reaches a coordinator over gRPC or in process (``link``, its one ``CoordinatorLink``
Protocol), the registry (``registry``), an agent's side of a restore round (``rounds``) and
where it fetches an item (``sources``), a rank's membership with replication and its
backups from order to commit (``membership``, ``replication``, ``backup_orders``). Every
job goes through
here, a one-node job too (its coordinator is in its own daemon). Imports ``transport``,
``storage`` and below.
"""
