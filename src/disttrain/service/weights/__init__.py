"""Weight sync: a TrainingService streams its weights to inference engines ("consumers"), and never hangs.

    sync = await service.weight_sync(consumers=2, dtype="bfloat16")   # every rank listens on a port
    # each engine process:  receiver = WeightReceiver(sync.endpoint, name="engine0")
    #                       version = receiver.receive(); receiver.load_into(model)
    report = await sync.push()              # version 1: full tensors, in buckets
    report = await sync.push(delta=True)    # only the elements that changed since the consumer's version

Every training rank sends its own part of the model straight to every consumer: under FSDP or tensor parallel
its shards (with their offsets in the full tensor), under a pipeline its stage; a tensor that several ranks hold
whole (DDP, a replicated axis) is sent by one of them, chosen by its name, so the ranks share the bytes. No rank
gathers the whole model. A consumer assembles the full tensors, checks each bucket's CRC-32 and that every
tensor is covered, and only then takes the new version and acknowledges it; otherwise it refuses the version
(keeping the weights it had) and says why.

The stream, on one connection per (rank, consumer), in the wire's frames (`wire.py`: JSON + safetensors, no
pickle):

    consumer -> rank   hello  {name, token, pid}
    rank -> consumer   begin  {version, base, buckets}         base: the version a delta applies to (0: full)
                       bucket {version, index, crc32, pieces}  + tensors; a piece: name, global shape, offset,
                                                                 local shape, and dense values or a delta: the
                                                                 changed elements' values with their indices or a
                                                                 bit mask, whichever is smaller
                       end    {version, buckets}
    consumer -> rank   ack {version} | nack {version, error}

Each rank's `push` waits at most `timeout_s` for the consumers to connect, to take the bytes and to answer; a
consumer that is dead, slow or refuses is named in a `WeightSyncError` (with its name, pid and address), is
dropped, and the trainer stays usable. A consumer that connects later gets a full version.

The code: pieces.py (what one rank sends, the names and errors both sides share), publisher.py (a rank's sending
side), receiver.py (an engine's `WeightReceiver`), sync.py (the driver's `WeightSync`).
"""

from disttrain.service.weights.pieces import (
    DTYPES,
    SCHEME,
    Piece,
    WeightSyncError,
    endpoint,
    local_pieces,
    parse_dtype,
)
from disttrain.service.weights.publisher import Publisher, own_address
from disttrain.service.weights.receiver import WeightReceiver
from disttrain.service.weights.sync import WeightSync

__all__ = ["DTYPES", "SCHEME", "Piece", "Publisher", "WeightReceiver", "WeightSync", "WeightSyncError", "endpoint",
           "local_pieces", "own_address", "parse_dtype"]
