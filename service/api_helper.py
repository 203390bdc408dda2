"""An API helper process (``service.api_processes``): the whole API on the socket the
controller gave it, with wakes and ``/metrics`` passed to the controller."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Iterator
from multiprocessing.connection import Connection

import uvicorn

from contract.logs import LOG_FORMAT
from contract.prctl import set_parent_death_signal, set_process_name
from service.api.app import create_app
from service.api_processes import PROCESS_NAME, ControllerLink
from service.reconciler_process import Start
from service.secrets import load_keyring
from service.settings import ControllerSettings


def main(argv: list[str]) -> None:
    """The helper (``api_processes.HELPER_MAIN``), with the arguments LISTENER_FD LINK_FD
    PARENT_PID."""
    listener_fd, link_fd, parent = (int(a) for a in argv)
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the controller died before the line above
        return
    set_process_name(PROCESS_NAME)
    link = Connection(link_fd)
    try:
        start: Start = link.recv()
    except EOFError:  # the controller stopped as this helper started
        return
    logging.basicConfig(level=start.log_level, format=LOG_FORMAT)
    serve(start.settings, socket.socket(fileno=listener_fd), ControllerLink(link))


def serve(settings: ControllerSettings, listener: socket.socket, link: ControllerLink) -> None:
    """Answer the API on ``listener`` until ``link`` closes."""
    app = create_app(settings, keyring=load_keyring(settings), controller=link)
    server = HelperServer(
        uvicorn.Config(
            app,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
            access_log=False,
            timeout_keep_alive=settings.keep_alive_s,
        )
    )

    def stop() -> None:
        server.should_exit = True

    link.listen(stop)
    server.run(sockets=[listener])


class HelperServer(uvicorn.Server):
    """uvicorn's server, minus its signal handlers: a helper stops when the controller
    closes its pair, not on a signal (a service manager's SIGTERM to every process of the
    controller is the controller's to handle)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
