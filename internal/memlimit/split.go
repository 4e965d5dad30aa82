package memlimit

// Split is what the buffers that would otherwise grow with a burst get of
// a limit. The rest of the limit is the Go runtime's to share among what
// does not follow a burst: the connections' buffers, the batches in hand
// (bounded by count, and drawn from the fetches), and the heap's room to
// grow between two collections.
//
//   - A quarter of the limit for the two consumer groups' fetches, an
//     eighth each. A group has at most MaxConcurrentFetches fetches in
//     flight or buffered, of at most FetchMaxBytes on the wire each.
//     Decoded, a fetch takes more than its bytes on the wire: each record
//     gets a struct of about 180 bytes besides its key and value, and a
//     compressed batch is held decompressed. Small compressed records
//     (JSON of a hundred bytes, snappy) take up to eight times their
//     wire bytes, so FetchMaxBytes is the group's eighth over eight
//     times MaxConcurrentFetches: limit/256.
//   - An eighth of the limit for the producers' buffered records
//     (ProducerBytes), split evenly among the clients that write
//     (ProducerBufferedBytes).
//   - A quarter of the limit, at least 8 MiB, for one fetched batch
//     decompressed (MaxDecompressBatchBytes): franz-go decompresses a
//     batch whole before it reads its records, and allows 1 GiB, so a
//     batch of a few KiB on the wire (a megabyte of zeros compresses a
//     thousandfold) would take the process past any limit. A producer's
//     batch (1 MB on the wire by Kafka's default message.max.bytes)
//     reaches 8 MiB only compressed more than eightfold.
type Split struct {
	// FetchMaxBytes bounds a fetch response (kgo.FetchMaxBytes): limit/256,
	// between 64 KiB and 50 MiB (franz-go's default). A first batch larger
	// than it still comes, so that a large record is read.
	FetchMaxBytes int32
	// FetchMaxPartitionBytes bounds a partition's part of a fetch
	// (kgo.FetchMaxPartitionBytes): FetchMaxBytes, at most 1 MiB
	// (franz-go's and Kafka's default).
	FetchMaxPartitionBytes int32
	// MaxConcurrentFetches bounds a group's fetches in flight or buffered
	// (kgo.MaxConcurrentFetches); franz-go's default is one per broker,
	// however many brokers there are. Four let a group read from four
	// brokers at once, so that a fetch waiting on a broker with nothing
	// new does not hold up the others.
	MaxConcurrentFetches int
	// ProducerBytes is what the producers' clients buffer together:
	// limit/8.
	ProducerBytes int64
	// MaxDecompressBatchBytes bounds one fetched batch decompressed
	// (kgo.MaxDecompressBatchBytes): limit/4, between 8 MiB and 1 GiB
	// (franz-go's default). A batch past it is not read: the consumer
	// dead-letters its offsets and reads on after it.
	MaxDecompressBatchBytes int32
}

const (
	fetchGroups          = 2
	fetchShare           = 4 // of the limit, for the groups' fetches together
	decodedPerWire       = 8 // decoded bytes per fetched byte, at worst
	maxConcurrentFetches = 4
	producerShare        = 8 // of the limit, for the producers' buffers
	minFetchBytes        = 64 * KiB
	maxFetchBytes        = 50 * MiB
	maxPartitionBytes    = 1 * MiB
	decompressShare      = 4 // of the limit, for one batch decompressed
	minDecompressBytes   = 8 * MiB
	maxDecompressBytes   = 1 * GiB
)

// SplitOf is the split of limit.
func SplitOf(limit int64) Split {
	fetch := limit / fetchShare / fetchGroups / maxConcurrentFetches / decodedPerWire
	fetch = min(max(fetch, minFetchBytes), maxFetchBytes)
	return Split{
		FetchMaxBytes:           int32(fetch),
		FetchMaxPartitionBytes:  int32(min(fetch, maxPartitionBytes)),
		MaxConcurrentFetches:    maxConcurrentFetches,
		ProducerBytes:           limit / producerShare,
		MaxDecompressBatchBytes: int32(min(max(limit/decompressShare, minDecompressBytes), maxDecompressBytes)),
	}
}

// ProducerBufferedBytes is one client's share of ProducerBytes
// (kgo.MaxBufferedBytes) among clients that write, at least largest (the
// largest record they write: a record larger than a client's buffer is
// refused at once).
func (s Split) ProducerBufferedBytes(clients int, largest int) int64 {
	return max(s.ProducerBytes/int64(max(clients, 1)), int64(largest))
}
