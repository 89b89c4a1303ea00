// dtk/core/launch/broken_pipes.hpp — what SIGPIPE does in a distributed rank.
//
// Gloo writes to its sockets with writev(), which raises SIGPIPE when the peer has gone (c10d's
// store sends with MSG_NOSIGNAL; Gloo does not). With the default action a rank whose peer was
// killed died silently (exit 141) instead of reporting the lost peer in its one error line,
// whenever it was writing rather than reading at that moment. Python, hence Megatron and
// DeepSpeed, ignores SIGPIPE from the start; ignoring it outright here would also keep a rank
// training on after `dtk train | head` closed its output. So the handler ends the process as the
// default action would only when its stdout or stderr has lost its reader; otherwise the write
// fails with EPIPE and the backend throws, naming the peer.
#pragma once

namespace dtk::core {

// Installs the handler (idempotent). A SIGPIPE the process inherited as ignored stays ignored.
void route_broken_pipes();

}  // namespace dtk::core
