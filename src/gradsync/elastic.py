"""``gradsync.elastic``: a dead replica does not end the job; a new or restarted one joins at a window boundary.

Launch with ``gradsync run`` (``tools/run.py``); the parts are in ``layers/elastic.py`` (membership),
``layers/elastic_join.py`` (admission, state transfer) and ``layers/elastic_data.py`` (the sampler).
"""
from .layers.elastic import MembershipError, MembershipEvent, events, init_process_group, members, register
from .layers.elastic_data import ElasticSampler

__all__ = ["ElasticSampler", "MembershipError", "MembershipEvent", "events", "init_process_group", "members",
           "register"]
