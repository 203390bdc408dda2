"""How every relaunch process writes its log lines (the controller and its reconciler's
process, agents, launchers), so that one node's or one host's lines read alike."""

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
