/*
 * sock.h: the client socket's options (a base file: it includes nothing of the worker).
 */
#ifndef GP_WK_SOCK_H
#define GP_WK_SOCK_H

/* Makes the client socket blocking, TCP_NODELAY and keepalives on TCP. 0, or -1 (not an open
 * descriptor). Both modes use it: main.c on --fd, prestart.c on the socket of worker_session. */
int wk_prepare_socket(int fd);

#endif /* GP_WK_SOCK_H */
