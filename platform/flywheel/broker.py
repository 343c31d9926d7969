"""kombu's filesystem transport (the broker of `make run`), with messages that appear whole.

kombu writes a message file in place (create, then write), while a consumer moves any file it lists and reads
it: a consumer that lists the file between the two reads it empty and the worker dies on the JSON
("Unrecoverable error: JSONDecodeError"). With beat, two workers and the web process all writing, that
happens. Here a message is written under a name consumers skip and renamed into place: a rename within one
folder is atomic, so a consumer sees the whole message or nothing."""

from __future__ import annotations

import os
import uuid
from time import monotonic

from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        # A leading dot: `_get` keeps files whose name after the first dot is `<queue>.msg`; this one's is not.
        partial = os.path.join(self.data_folder_out, f".{name}.partial")
        try:
            with open(partial, "wb") as handle:
                handle.write(str_to_bytes(dumps(payload)))
            os.replace(partial, os.path.join(self.data_folder_out, name))
        except OSError as exc:
            raise filesystem.ChannelError(f"Cannot add file {name!r} to directory") from exc


class FilesystemTransport(filesystem.Transport):
    Channel = Channel

    @property
    def default_connection_params(self) -> dict:
        # A folder has no host. kombu's virtual transports default to hostname "localhost" and warn "No
        # hostname was supplied" from every connection of every process, eight times over a `make run` start.
        return {"port": self.default_port}
