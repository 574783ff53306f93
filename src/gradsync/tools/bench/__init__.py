"""``gradsync bench``: gradsync against torch's DDP, side by side (``run``), measured (``measure``)
on the models of ``models``, written up by ``report`` and ``plots``; ``docs`` keeps the numbers
quoted in the docs equal to the newest results."""
