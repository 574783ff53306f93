"""``gradsync.elastic``: a dead replica does not end the job; a new or restarted one joins at a window boundary.

Launch with ``gradsync run`` (``tools/elastic/run.py``), or under any launcher with ``gradsync coordinator``
(``elastic/identity.py``); the parts are in ``elastic/membership.py`` (membership),
``elastic/join.py`` (admission, state transfer) and ``elastic/data.py`` (the sampler).
"""
from .attach import init_process_group
from .membership import MembershipError, MembershipEvent, events, members, register, replica_id, stopping
from .data import ElasticSampler

__all__ = ["ElasticSampler", "MembershipError", "MembershipEvent", "events", "init_process_group", "members",
           "register", "replica_id", "stopping"]
