/* libFuzzer target for kvq serve's HTTP layer: the input is the bytes a client
 * sends on one connection (request lines, headers, bodies, several pipelined),
 * through libmicrohttpd and src/server/http.c on a loopback server started once:
 * routing, the API key, the limits answered from the headers, URL unescaping,
 * body buffering, JSON parsing. No model: generation requests that parse, and
 * llama-server's endpoints and embeddings, are answered 503. Each input is sent on a new connection whose sending side is then
 * closed; the answer is read until the server closes it.
 * Build with clang:
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKVQ_FUZZ=ON -DKVQ_SANITIZE=ON
 *   cmake --build build-fuzz --target fuzz_http
 *   ./build-fuzz/fuzz_http -max_total_time=60 -max_len=4096 -dict=fuzz/http.dict CORPUS_DIR
 * Seeds: a few requests, e.g. "POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer k\r\n
 * Content-Length: 15\r\n\r\n{\"prompt\":\"a\"}". */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "server/http.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct http_server *server;
static int port;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    signal(SIGPIPE, SIG_IGN);
    /* small limits, so the fuzzer reaches them; a key, so both sides of the check run */
    struct http_params p = {.host = "127.0.0.1", .api_key = "k", .max_body = 4096, .model_id = "m", .ping_seconds = 1,
                            .timeout_s = 2, .max_connections = 64, .max_connections_per_ip = 64};
    if (!(server = http_start(&p))) {
        fprintf(stderr, "fuzz_http: cannot start the server\n");
        exit(1);
    }
    port = http_port(server);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return 0;
    struct timeval tv = {3, 0}; /* past the server's 2 s idle timeout: an answer or a close always comes first */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
        for (size_t off = 0; off < size;) { /* the server may answer and close early */
            ssize_t n = send(fd, data + off, size - off, MSG_NOSIGNAL);
            if (n <= 0) break;
            off += (size_t)n;
        }
        shutdown(fd, SHUT_WR);
        char buf[4096];
        while (recv(fd, buf, sizeof buf, 0) > 0) {
        }
    }
    close(fd);
    return 0;
}
