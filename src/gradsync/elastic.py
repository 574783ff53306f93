"""``gradsync.elastic``: a dead replica does not end the job (``layers/elastic.py``; launch with ``gradsync run``)."""
from .layers.elastic import MembershipError, MembershipEvent, events, init_process_group, members

__all__ = ["MembershipError", "MembershipEvent", "events", "init_process_group", "members"]
