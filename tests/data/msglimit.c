/* Refuses any MPI message over MPISTAGE_TEST_MAX_BYTES bytes: a PMPI layer
 * that tests load with LD_PRELOAD into every rank. An MPI without MPI-4
 * large counts (Open MPI 4.1) refuses messages over 2**31 - 1 bytes; this
 * does the same at a limit a test can reach with small data. A refused call
 * says which on stderr and aborts the job. At MPI_Finalize each process
 * appends "checked LARGEST" to MPISTAGE_TEST_LIMIT_LOG, so a test can tell
 * that the layer was there. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static long long largest, checked;

static void check(const char *call, MPI_Count count, MPI_Datatype type)
{
    static long long limit = -1;
    int size = 0;
    if (limit < 0) {
        const char *text = getenv("MPISTAGE_TEST_MAX_BYTES");
        limit = text ? atoll(text) : (1LL << 31) - 1;
    }
    PMPI_Type_size(type, &size);
    long long bytes = (long long)count * size;
    checked++;
    if (bytes > largest)
        largest = bytes;
    if (bytes > limit) {
        fprintf(stderr, "msglimit: %s of %lld bytes, over the limit of %lld\n",
                call, bytes, limit);
        fflush(stderr);
        PMPI_Abort(MPI_COMM_WORLD, 3);
        _exit(3);
    }
}


int MPI_Send(const void *buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm)
{ check("MPI_Send", count, type); return PMPI_Send(buf, count, type, dest, tag, comm); }
int MPI_Send_c(const void *buf, MPI_Count count, MPI_Datatype type, int dest, int tag, MPI_Comm comm)
{ check("MPI_Send_c", count, type); return PMPI_Send_c(buf, count, type, dest, tag, comm); }
int MPI_Isend(const void *buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm, MPI_Request *r)
{ check("MPI_Isend", count, type); return PMPI_Isend(buf, count, type, dest, tag, comm, r); }
int MPI_Isend_c(const void *buf, MPI_Count count, MPI_Datatype type, int dest, int tag, MPI_Comm comm, MPI_Request *r)
{ check("MPI_Isend_c", count, type); return PMPI_Isend_c(buf, count, type, dest, tag, comm, r); }
int MPI_Recv(void *buf, int count, MPI_Datatype type, int src, int tag, MPI_Comm comm, MPI_Status *s)
{ check("MPI_Recv", count, type); return PMPI_Recv(buf, count, type, src, tag, comm, s); }
int MPI_Recv_c(void *buf, MPI_Count count, MPI_Datatype type, int src, int tag, MPI_Comm comm, MPI_Status *s)
{ check("MPI_Recv_c", count, type); return PMPI_Recv_c(buf, count, type, src, tag, comm, s); }
int MPI_Irecv(void *buf, int count, MPI_Datatype type, int src, int tag, MPI_Comm comm, MPI_Request *r)
{ check("MPI_Irecv", count, type); return PMPI_Irecv(buf, count, type, src, tag, comm, r); }
int MPI_Irecv_c(void *buf, MPI_Count count, MPI_Datatype type, int src, int tag, MPI_Comm comm, MPI_Request *r)
{ check("MPI_Irecv_c", count, type); return PMPI_Irecv_c(buf, count, type, src, tag, comm, r); }
int MPI_Mrecv(void *buf, int count, MPI_Datatype type, MPI_Message *m, MPI_Status *s)
{ check("MPI_Mrecv", count, type); return PMPI_Mrecv(buf, count, type, m, s); }
int MPI_Mrecv_c(void *buf, MPI_Count count, MPI_Datatype type, MPI_Message *m, MPI_Status *s)
{ check("MPI_Mrecv_c", count, type); return PMPI_Mrecv_c(buf, count, type, m, s); }
int MPI_Imrecv(void *buf, int count, MPI_Datatype type, MPI_Message *m, MPI_Request *r)
{ check("MPI_Imrecv", count, type); return PMPI_Imrecv(buf, count, type, m, r); }
int MPI_Imrecv_c(void *buf, MPI_Count count, MPI_Datatype type, MPI_Message *m, MPI_Request *r)
{ check("MPI_Imrecv_c", count, type); return PMPI_Imrecv_c(buf, count, type, m, r); }
int MPI_Bcast(void *buf, int count, MPI_Datatype type, int root, MPI_Comm comm)
{ check("MPI_Bcast", count, type); return PMPI_Bcast(buf, count, type, root, comm); }
int MPI_Bcast_c(void *buf, MPI_Count count, MPI_Datatype type, int root, MPI_Comm comm)
{ check("MPI_Bcast_c", count, type); return PMPI_Bcast_c(buf, count, type, root, comm); }
int MPI_Ibcast(void *buf, int count, MPI_Datatype type, int root, MPI_Comm comm, MPI_Request *r)
{ check("MPI_Ibcast", count, type); return PMPI_Ibcast(buf, count, type, root, comm, r); }
int MPI_Ibcast_c(void *buf, MPI_Count count, MPI_Datatype type, int root, MPI_Comm comm, MPI_Request *r)
{ check("MPI_Ibcast_c", count, type); return PMPI_Ibcast_c(buf, count, type, root, comm, r); }
int MPI_Gatherv(const void *sb, int sc, MPI_Datatype st, void *rb, const int rc[], const int d[], MPI_Datatype rt, int root, MPI_Comm comm)
{ check("MPI_Gatherv", sc, st); return PMPI_Gatherv(sb, sc, st, rb, rc, d, rt, root, comm); }
int MPI_Gatherv_c(const void *sb, MPI_Count sc, MPI_Datatype st, void *rb, const MPI_Count rc[], const MPI_Aint d[], MPI_Datatype rt, int root, MPI_Comm comm)
{ check("MPI_Gatherv_c", sc, st); return PMPI_Gatherv_c(sb, sc, st, rb, rc, d, rt, root, comm); }
int MPI_File_read_at_all(MPI_File f, MPI_Offset o, void *buf, int count, MPI_Datatype type, MPI_Status *s)
{ check("MPI_File_read_at_all", count, type); return PMPI_File_read_at_all(f, o, buf, count, type, s); }
int MPI_File_read_at_all_c(MPI_File f, MPI_Offset o, void *buf, MPI_Count count, MPI_Datatype type, MPI_Status *s)
{ check("MPI_File_read_at_all_c", count, type); return PMPI_File_read_at_all_c(f, o, buf, count, type, s); }

int MPI_Finalize(void)
{
    const char *log = getenv("MPISTAGE_TEST_LIMIT_LOG");
    if (log) {
        FILE *f = fopen(log, "a");
        if (f) {
            fprintf(f, "%lld %lld\n", checked, largest);
            fclose(f);
        }
    }
    return PMPI_Finalize();
}
