"""``relaunch admin``: the operator's commands that act on the controller's database
directly, with the controller's own settings, as the migrations by hand do.

They need no API token but the database and the secrets keys: run them where a
controller runs, with its environment.
"""

from __future__ import annotations

import typer

from contract.cli import LogLevelOption, fail, load_settings, setup_logging

admin_app = typer.Typer(
    help="Operator commands run against the controller's database with its settings "
    "(RELAUNCH_* and DATABASE_URL), not through the API",
    no_args_is_help=True,
)


@admin_app.command("rotate-secrets")
def rotate_secrets(log_level: LogLevelOption = "warning") -> None:
    """Encrypt every job's env again with the first secrets key, plaintext rows too.

    To rotate: put the new key first and keep the old one after it (RELAUNCH_SECRETS_KEYS
    or the key file) on every controller and restart them; run this; then drop the old
    key. It never makes a key, and stops, changing nothing more, at a value no key opens.
    """
    from service.db import make_engine, make_session_factory, wait_for_database
    from service.secrets import SecretsKeyError, load_keyring
    from service.secrets_db import rotate
    from service.settings import ControllerSettings

    setup_logging(log_level)
    settings = load_settings(ControllerSettings, "controller")
    engine = make_engine(settings.db_url)
    try:
        wait_for_database(engine, settings.database_wait_s)
        keyring = load_keyring(settings, may_create=False)
        count = rotate(make_session_factory(engine), keyring)
    except (SecretsKeyError, RuntimeError) as exc:
        raise fail(str(exc)) from exc
    finally:
        engine.dispose()
    typer.echo(f"re-encrypted the env of {count} jobs with the first key of {keyring.source}")


@admin_app.command("new-secrets-key")
def new_secrets_key() -> None:
    """Print a new random key for RELAUNCH_SECRETS_KEYS or RELAUNCH_SECRETS_KEY_FILE."""
    from cryptography.fernet import Fernet

    typer.echo(Fernet.generate_key().decode("ascii"))
